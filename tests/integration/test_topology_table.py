"""The topology table on any machine: every CUDA row is a valid deploy/serve.yaml configuration whose
deployments and rank bundles ask Ray for exactly the GPUs the row says it needs, so a GPU run cannot fail
on a table mistake, and the CPU twins stay the same rows."""
from __future__ import annotations

import pytest

from decode_worker.deployment import group_spec
from deploy.app import build_app
from deploy.config import TandemConfig
from tests.support.deployments import bound_deployments
from tests.support.topologies import TOPOLOGIES, Topology

ROWS = [pytest.param(t, id=t.name) for t in TOPOLOGIES if not t.not_built]


@pytest.mark.parametrize("topology", ROWS)
def test_cuda_row_asks_ray_for_the_gpus_it_needs(topology: Topology, tiny_model_dir):
    cfg = TandemConfig(**topology.serve_args("cuda", tiny_model_dir, tiny_model_dir))
    prefill = bound_deployments(build_app(cfg))["prefill"]
    bundle = group_spec(cfg.decode()).resources.bundle()
    assert prefill.ray_actor_options["num_gpus"] == topology.prefill_gpus
    assert bundle["GPU"] == topology.rank_gpus
    gpus = cfg.prefill_replicas * topology.prefill_gpus + cfg.decode_replicas * cfg.tp * topology.rank_gpus
    assert gpus == pytest.approx(topology.gpus), f"{topology.name} asks Ray for {gpus} GPUs, says it needs {topology.gpus}"
    # Sharing a GPU is the only case where CUDA IPC is possible (and NCCL is not).
    assert (topology.cuda_transport == "ipc") == (topology.prefill_gpus + topology.rank_gpus <= 1)
    assert cfg.handover_transport == "auto"  # the user's default chooses the transport on CUDA


@pytest.mark.parametrize("topology", ROWS)
def test_cpu_twin_is_the_same_row(topology: Topology, tiny_model_dir):
    cuda = TandemConfig(**topology.serve_args("cuda", tiny_model_dir, tiny_model_dir))
    cpu = TandemConfig(**topology.serve_args("cpu", tiny_model_dir, tiny_model_dir))
    same = {"tp", "attention_dp", "prefill_replicas", "decode_replicas", "speculative_method",
            "num_speculative_tokens", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens", "dtype"}
    assert {f: getattr(cpu, f) for f in same} == {f: getattr(cuda, f) for f in same}
    assert group_spec(cpu.decode()).resources.bundle().get("GPU", 0) == 0
