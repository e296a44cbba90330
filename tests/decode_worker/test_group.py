"""RankGroup: steps reach the ranks over step links (cluster/step_link.py); a rank that dies fails the step
waiting on it at once, not at the step deadline."""
from __future__ import annotations

import asyncio

import pytest
import ray

from cluster.errors import WorkerDiedError
from cluster.placement import RankResources
from cluster.protocol import RankStep
from cluster.settings import EngineSettings
from decode_worker.group import GroupSpec, RankGroup

pytestmark = pytest.mark.ray


def _spec(model: str, tp: int, step_link: bool = True) -> GroupSpec:
    return GroupSpec(engine=EngineSettings(model=model, num_kv_blocks=32, block_size=16), tp_size=tp,
                     resources=RankResources(num_cpus=0.5), step_link=step_link, step_timeout_s=60.0)


def _idle(tp: int) -> list[RankStep]:
    return [RankStep(commands=(), forward=False, reports_tokens=r == 0) for r in range(tp)]


def test_steps_over_links_report_like_steps_over_ray_calls(ray_session, tiny_model_dir):
    async def main():
        linked, called = await RankGroup.start(_spec(tiny_model_dir, 2)), \
            await RankGroup.start(_spec(tiny_model_dir, 2, step_link=False))
        try:
            assert len(linked.links) == 2 and not called.links
            queued = [linked.submit(_idle(2), 0.0) for _ in range(3)]  # several in flight, answered in order
            by_link = [await q for q in queued]
            by_call = [await called.step(_idle(2), 0.0) for _ in range(3)]
            return by_link, by_call
        finally:
            linked.kill()
            called.kill()

    by_link, by_call = asyncio.run(main())
    for a, b in zip(by_link, by_call):
        assert [r.tp_rank for r in a] == [r.tp_rank for r in b] == [0, 1]
        assert [(r.kv_blocks_total, r.num_running, r.deltas) for r in a] == \
            [(r.kv_blocks_total, r.num_running, r.deltas) for r in b]


def test_a_rank_killed_mid_step_fails_the_step_by_its_link_not_its_deadline(ray_session, tiny_model_dir):
    async def main():
        group = await RankGroup.start(_spec(tiny_model_dir, 2))
        try:
            await group.step(_idle(2), 0.0)
            # An idle step long-polls for hand-over events (here 20 s): it is still running when rank 1 dies.
            waiting = group.submit(_idle(2), 20.0)
            await asyncio.sleep(0.5)
            ray.kill(group.ranks[1], no_restart=True)
            # The link's error, not the step's deadline (20 s + 60 s, which would say "a step took over 60s").
            with pytest.raises(WorkerDiedError, match="rank 1 closed its step link"):
                await waiting
        finally:
            group.kill()

    asyncio.run(main())
