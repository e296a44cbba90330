"""build_app: the placement a user writes (TandemConfig / Serve YAML args / `tandem serve` flags) reaches the
deployments' ray_actor_options and the decode ranks' placement-group bundles."""
from __future__ import annotations

import pytest

from decode_worker.deployment import group_spec
from deploy.app import build_app
from deploy.config import TandemConfig
from deploy.serve_cmd import parser, tandem_config
from tests.support.deployments import bound_deployments


def test_defaults_place_by_device(tiny_model_dir):
    d = bound_deployments(build_app(TandemConfig(model=tiny_model_dir)))
    assert d["prefill"].ray_actor_options == {"num_cpus": 1.0, "num_gpus": 0.0, "resources": {}}
    assert d["decode"].ray_actor_options == d["router"].ray_actor_options == {"num_cpus": 0, "resources": {}}
    spec = group_spec(TandemConfig(model=tiny_model_dir).decode())
    assert spec.resources.bundle() == {"CPU": 1.0} and spec.tp_size == 2


def test_resources_reach_replicas_and_rank_bundles(tiny_model_dir):
    cfg = TandemConfig(model=tiny_model_dir, prefill_num_cpus=2, prefill_resources={"tandem_prefill": 1},
                       rank_num_cpus=0.5, rank_resources={"tandem_decode": 1}, router_resources={"tandem_head": 0.1})
    d = bound_deployments(build_app(cfg))
    assert d["prefill"].ray_actor_options == {"num_cpus": 2.0, "num_gpus": 0.0, "resources": {"tandem_prefill": 1}}
    assert d["router"].ray_actor_options == {"num_cpus": 0, "resources": {"tandem_head": 0.1}}
    assert d["decode"].ray_actor_options == {"num_cpus": 0, "resources": {"tandem_head": 0.1}}
    assert group_spec(cfg.decode()).resources.bundle() == {"CPU": 0.5, "tandem_decode": 1}


def test_gpu_shares_on_cuda(tiny_model_dir):
    """Prefill and a decode rank on one GPU: half each (issue 16's one-GPU topology)."""
    cfg = TandemConfig(model=tiny_model_dir, device="cuda", prefill_num_gpus=0.5, rank_num_gpus=0.5, tp=1)
    assert bound_deployments(build_app(cfg))["prefill"].ray_actor_options["num_gpus"] == 0.5
    assert group_spec(cfg.decode()).resources.bundle() == {"CPU": 1.0, "GPU": 0.5}
    whole = TandemConfig(model=tiny_model_dir, device="cuda")
    assert bound_deployments(build_app(whole))["prefill"].ray_actor_options["num_gpus"] == 1.0
    assert group_spec(whole.decode()).resources.bundle() == {"CPU": 1.0, "GPU": 1.0}


@pytest.mark.parametrize("field, value, message", [
    ("prefill_num_gpus", 1, "CPU engine"), ("rank_num_gpus", 0.5, "CPU engine"),
    ("prefill_num_gpus", 1.5, "less than or equal to 1"), ("rank_num_gpus", -1, "greater than or equal to 0"),
    ("prefill_resources", {"tandem_prefill": -1}, ">= 0"), ("rank_resources", {"CPU": 2}, "own fields"),
    ("router_resources", {"x": -0.1}, ">= 0")])
def test_bad_placement_is_refused_with_the_field_named(tiny_model_dir, field, value, message):
    with pytest.raises(ValueError, match=message) as e:
        TandemConfig(model=tiny_model_dir, **{field: value})
    assert field in str(e.value)


def test_placement_flags(tiny_model_dir):
    args = parser().parse_args(["--model", tiny_model_dir, "--prefill-resources", '{"tandem_prefill": 1}',
                                "--rank-resources", '{"tandem_decode": 1}', "--router-resources",
                                '{"tandem_head": 0.5}', "--rank-num-cpus", "0.5"])
    cfg = tandem_config(args)
    assert (cfg.prefill_resources, cfg.rank_resources, cfg.router_resources) == \
        ({"tandem_prefill": 1}, {"tandem_decode": 1}, {"tandem_head": 0.5})
    assert cfg.decode().rank_resources == {"tandem_decode": 1} and cfg.prefill_num_gpus is None
    for bad in ("tandem_prefill=1", "[1]"):
        with pytest.raises(SystemExit):
            parser().parse_args(["--prefill-resources", bad])


def test_one_machine_declares_what_a_cluster_config_asks_for(tiny_model_dir):
    """`tandem serve` without --address is one node: it must declare the node kinds' resources the config
    asks for, or the deployments would wait for nodes that never join."""
    cfg = TandemConfig(model=tiny_model_dir, prefill_replicas=2, tp=2, decode_replicas=1,
                       prefill_resources={"tandem_prefill": 1}, rank_resources={"tandem_decode": 1},
                       router_resources={"tandem_head": 0.5})
    assert cfg.custom_resources_needed() == {"tandem_prefill": 2, "tandem_decode": 2, "tandem_head": 1.0}
    assert TandemConfig(model=tiny_model_dir).custom_resources_needed() == {}
