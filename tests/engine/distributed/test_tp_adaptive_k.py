"""Adaptive k under tensor parallelism (tp=2 over gloo in two processes): both ranks run the start-up cost probe's
steps together (their collectives meet) and take rank 0's times (engine/runner/cost_probe.py rank0s), so they price
k alike, decide the same k every step and stay in lockstep; tokens equal one process without speculation."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig

from tests.support.ranks import drive, run_ranks

pytestmark = pytest.mark.slow

PROMPTS = [[5, 9, 22, 41, 8, 120, 7], [3, 4, 5], list(range(10, 40))]


def _config(root: str, spec: bool, **overrides) -> EngineConfig:
    s = SpecConfig(method="mtp", k=3, draft=f"{root}/mtp", adaptive_k=True) if spec else None
    return EngineConfig(model=f"{root}/target", num_kv_blocks=128, block_size=16, max_num_seqs=4, speculative=s,
                        **overrides)


def _requests() -> list[tuple]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    return [(str(i), p, params, 2 * i) for i, p in enumerate(PROMPTS)]


def _rank_main(rank: int, port: int, root: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        engine = LLMEngine(_config(root, True, tp_size=2, tp_rank=rank), tp_group=dist.group.WORLD)
        adaptive = engine.drafter.adaptive
        probe = {b: list(t) for b, t in adaptive.cost._probe.items()}
        done = drive(engine, _requests(), dist.group.WORLD)
        queue.put((rank, "tp", {rid: tokens for rid, (tokens, _) in done.items()}, probe,
                   engine.stats()["spec"]["dynamic_k_steps"], engine.stats()["kv_blocks_used"]))
    except BaseException as e:  # noqa: BLE001 - reported to the test, which would otherwise wait
        queue.put((rank, "error", repr(e), None, None, None))
        raise
    finally:
        dist.destroy_process_group()


def test_tp_ranks_share_rank0s_probe_and_stay_lossless(zoo_dir):
    got = run_ranks(_rank_main, (str(zoo_dir),), 1)
    want = {rid: tokens for rid, (tokens, _) in drive(LLMEngine(_config(str(zoo_dir), False)), _requests(),
                                                      None).items()}
    (t0, probe0, steps0, used0), (t1, probe1, steps1, used1) = got[(0, "tp")], got[(1, "tp")]
    assert t0 == t1 == want
    assert probe0 == probe1 and sorted(probe0) == [1, 2, 4]  # the probed batch sizes
    assert all(len(times) == 4 and all(t > 0 for t in times) for times in probe0.values())
    assert steps0 == steps1 and sum(steps0) > 0  # the same k every step
    assert used0 == used1 == 0
