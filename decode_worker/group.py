"""RankGroup: the `tp` DecodeRank actors of one decode replica, placed together and stepped in lockstep.

A group is disposable: if any rank dies or a step misses its deadline, the whole group is killed
(a rank stuck in a collective with a dead peer cannot be trusted) and the replica builds a new one.
Steps travel over a step link per rank (cluster/step_link.py), not as Ray calls: a Ray call per rank per
step cost more CPU than a small model's step can spare.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import uuid
from dataclasses import dataclass

import ray

from cluster.errors import WorkerDiedError
from cluster.placement import RankResources, in_bundle, release, reserve_ranks
from cluster.protocol import DecodeTarget, KVLayout, RankEndpoint, RankStep, StepReport
from cluster.settings import EngineSettings
from cluster.step_link import TOKEN_BYTES, StepLink, StepLinkError
from decode_worker.rank import rank_actor_class
from engine.distributed.parallel import kv_head_slice

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    engine: EngineSettings  # every rank's engine, each with its own tp_rank
    tp_size: int
    resources: RankResources
    attention_dp: bool = False  # each rank owns its requests' whole-head KV (decode_worker/controller.py)
    strategy: str = "PACK"
    start_timeout_s: float = 300.0
    step_timeout_s: float = 120.0
    step_link: bool = True  # steps over step links; False: as Ray actor calls (kept to measure the two)


class RankGroup:
    def __init__(self, spec: GroupSpec, group_id: str, pg, ranks: list, target: DecodeTarget,
                 links: list[StepLink]):
        self.spec = spec
        self.group_id = group_id
        self.pg = pg
        self.ranks = ranks
        self.target = target
        self.links = links  # one per rank, in rank order; empty when steps go as Ray calls
        self._seq = 0  # the next step's RankStep.seq
        self._in_flight: asyncio.Future | None = None  # the last step submitted

    @staticmethod
    async def start(spec: GroupSpec) -> "RankGroup":
        group_id = uuid.uuid4().hex[:12]
        pg = await reserve_ranks(spec.tp_size, spec.resources, spec.strategy, spec.start_timeout_s,
                                 name=f"tandem-decode-{group_id}")
        cls = rank_actor_class(spec.resources.num_cpus, spec.resources.num_gpus)
        ranks = [cls.options(scheduling_strategy=in_bundle(pg, r), name=f"tandem-decode-{group_id}-rank{r}")
                 .remote(spec.engine, r, spec.tp_size, spec.attention_dp) for r in range(spec.tp_size)]
        links: list[StepLink] = []
        try:
            addresses = await asyncio.wait_for(asyncio.gather(*[r.address.remote() for r in ranks]),
                                               spec.start_timeout_s)
            layouts = await asyncio.wait_for(
                asyncio.gather(*[r.join.remote(addresses[0], group_id, spec.start_timeout_s) for r in ranks]),
                spec.start_timeout_s)
            if spec.step_link:
                token = secrets.token_bytes(TOKEN_BYTES)
                listening = await asyncio.wait_for(
                    asyncio.gather(*[r.open_step_link.remote(token) for r in ranks]), spec.start_timeout_s)
                for r, address in enumerate(listening):
                    links.append(await StepLink.open(tuple(address), token, f"decode group {group_id} rank {r}",
                                                     spec.start_timeout_s))
        except BaseException as e:
            _close(links)
            _kill(ranks)
            release(pg)
            if isinstance(e, (ray.exceptions.RayError, asyncio.TimeoutError, StepLinkError)):
                raise WorkerDiedError(f"decode group {group_id} failed to start: {e}") from e
            raise  # e.g. ProtocolVersionError: ranks of another Tandem version, which no rebuild mends
        layout: KVLayout = layouts[0]
        endpoints = tuple(
            RankEndpoint(actor=ranks[r], store=addresses[r], tp_rank=r,
                         kv_heads=rank_kv_heads(layout, spec.tp_size, r, spec.attention_dp))
            for r in range(spec.tp_size))
        target = DecodeTarget(group_id=group_id, ranks=endpoints, layout=layout, device=spec.engine.device)
        log.info("decode group %s up: tp=%d, layout %s", group_id, spec.tp_size, layout)
        return RankGroup(spec, group_id, pg, ranks, target, links)

    def target_for(self, ranks: tuple[int, ...]) -> DecodeTarget:
        """The address a prefill sends one request to: the ranks it is placed on (under ADP, one rank with
        whole KV heads or the whole MLA latent; under TP, all of them, each with its head slice, or each with the
        whole latent)."""
        if len(ranks) == len(self.target.ranks):
            return self.target
        return dataclasses.replace(self.target, ranks=tuple(self.target.ranks[r] for r in ranks))

    def submit(self, work: list[RankStep], wait_s: float) -> asyncio.Future:
        """Send the group's next step now (numbered after every step submitted before it, which the ranks
        run first); the future gives the reports: every rank applies its RankStep (one per rank, in rank
        order) and steps. It raises WorkerDiedError if any rank dies, or if the ranks do not answer within
        the step timeout counted from the end of the step submitted before it (a queued step is not blamed
        for its predecessor's time)."""
        assert len(work) == len(self.ranks), (len(work), len(self.ranks))
        seq, self._seq = self._seq, self._seq + 1
        work = [dataclasses.replace(w, seq=seq) for w in work]
        if self.links:
            calls = [link.call(w, wait_s) for link, w in zip(self.links, work)]
        else:
            calls = [asyncio.ensure_future(_await(r.step.remote(w, wait_s))) for r, w in zip(self.ranks, work)]
        self._in_flight = asyncio.ensure_future(self._reports(calls, wait_s, self._in_flight))
        return self._in_flight

    async def step(self, work: list[RankStep], wait_s: float) -> list[StepReport]:
        return await self.submit(work, wait_s)

    async def _reports(self, tasks: list[asyncio.Future], wait_s: float,
                       before: asyncio.Future | None) -> list[StepReport]:
        if before is not None and not before.done():
            await asyncio.wait([before])  # its failure is reported by its own future
        done, pending = await asyncio.wait(tasks, timeout=self.spec.step_timeout_s + wait_s,
                                           return_when=asyncio.FIRST_EXCEPTION)
        for t in done:
            if t.exception() is not None:
                for p in pending:
                    p.cancel()
                raise WorkerDiedError(f"decode group {self.group_id}: a rank failed: {t.exception()}") \
                    from t.exception()
        if pending:
            for p in pending:
                p.cancel()
            raise WorkerDiedError(f"decode group {self.group_id}: a step took over {self.spec.step_timeout_s:.0f}s")
        return [t.result() for t in tasks]

    async def pids(self) -> list[int]:
        return list(await asyncio.gather(*[r.pid.remote() for r in self.ranks]))

    def kill(self) -> None:
        _close(self.links)
        _kill(self.ranks)
        release(self.pg)


def rank_kv_heads(layout: KVLayout, tp_size: int, tp_rank: int, attention_dp: bool) -> tuple[int, int]:
    """(first KV head, count) of the whole model's cache that `tp_rank` holds, and so receives in a hand-over:
    - attention data parallelism: every head (the rank attends for its own requests alone);
    - a replicated layout (MLA's latent, one head TP cannot split): every head, on every rank;
    - otherwise the rank's slice, by the rule its attention weights were sharded with."""
    if attention_dp or layout.replicated:
        return 0, layout.num_kv_heads
    return kv_head_slice(layout.num_kv_heads, tp_size, tp_rank)


async def _await(ref):
    return await ref


def _close(links: list[StepLink]) -> None:
    for link in links:
        link.close()


def _kill(ranks: list) -> None:
    for r in ranks:
        try:
            ray.kill(r, no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
