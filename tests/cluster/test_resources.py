"""What replicas and ranks ask Ray for: the GPU default follows the device, shares and custom resources are
checked with messages a user can act on, and a rank's bundle carries its custom resources."""
from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from cluster.placement import RankResources
from cluster.resources import CustomResources, engine_gpus


class _Asks(BaseModel):
    resources: CustomResources = {}


@pytest.mark.parametrize("device, asked, want", [("cpu", None, 0.0), ("cuda", None, 1.0), ("cuda", 0.5, 0.5),
                                                 ("cuda", 1, 1.0), ("cpu", 0, 0.0)])
def test_the_gpu_share_defaults_to_the_device(device, asked, want):
    assert engine_gpus(device, asked, "x_num_gpus") == want


@pytest.mark.parametrize("device, asked, message", [
    ("cuda", 0, "needs a GPU share"), ("cpu", 1, "CPU engine"), ("cuda", 2, "between 0 and 1"),
    ("cuda", -0.5, "between 0 and 1")])
def test_a_gpu_share_that_cannot_work_is_refused_by_name(device, asked, message):
    with pytest.raises(ValueError, match=message) as e:
        engine_gpus(device, asked, "rank_num_gpus")
    assert "rank_num_gpus" in str(e.value)


def test_custom_resources_are_checked():
    assert _Asks(resources={"tandem_decode": 1, "other": 0.25}).resources == {"tandem_decode": 1.0, "other": 0.25}
    with pytest.raises(ValidationError, match=">= 0"):
        _Asks(resources={"tandem_decode": -1})
    with pytest.raises(ValidationError, match="own fields"):
        _Asks(resources={"GPU": 1})  # would reserve GPUs a second time, outside num_gpus
    with pytest.raises(ValidationError, match="not allowed"):
        _Asks(resources={"": 1})
    with pytest.raises(ValidationError):
        _Asks(resources={"tandem_decode": "many"})


def test_a_rank_bundle_carries_cpus_gpus_and_custom_resources():
    assert RankResources().bundle() == {"CPU": 1.0}
    assert RankResources(num_cpus=2, num_gpus=0.5, custom={"tandem_decode": 1}).bundle() == \
        {"CPU": 2, "GPU": 0.5, "tandem_decode": 1}
    assert RankResources(num_cpus=1, custom={"tandem_decode": 0}).bundle() == {"CPU": 1}  # Ray refuses zeros
