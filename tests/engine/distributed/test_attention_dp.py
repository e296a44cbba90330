"""Attention data parallelism (engine/distributed/data_parallel.py): two ranks over gloo (or shared memory), each with its
own requests, give the same tokens and the same draft acceptance as one process running all of them; blocks all
free.

Cases cover what broke elsewhere: a rank idle for the whole run and for many steps before its request
arrives (an idle rank must still match the MLP collectives, and must not enter draft work: sglang#29144,
#33892), very unequal loads, a long prompt prefilled in chunks on one rank while the other decodes, MTP
and EAGLE-3 (acceptance equal to one process: sglang#16274), guided requests, seeded sampling and the
all-reduce exchange. One pair of processes runs every case (spawning is the slow part).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from engine.distributed import shm_collectives
from engine.distributed.data_parallel import GroupPlan
from structured.request import StructuredOutput

from tests.support.ranks import drive, run_ranks

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@dataclass(frozen=True)
class Req:
    rank: int  # the ADP rank that owns it
    prompt: str
    max_tokens: int = 24
    start_step: int = 0  # added once the group has run this many steps
    guided: bool = False
    temperature: float = 0.0

    def params(self) -> SamplingParams:
        so = StructuredOutput(json_schema=SCHEMA) if self.guided else None
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=11, ignore_eos=not self.guided,
                              structured_output=so)


@dataclass(frozen=True)
class Case:
    name: str
    requests: tuple[Req, ...]
    method: str | None = None  # speculation: mtp | eagle3 | None
    exchange: str = "reduce_scatter"
    engine: dict = field(default_factory=dict)
    dynamic_k: tuple[int, ...] = ()  # with it, only tokens must match one process (k follows different batches)
    padded: bool = False  # decode steps in the CUDA-graph layout (run eagerly here): group-agreed padded sizes
    shm: bool = False  # the exchanges and the agreement through shared memory (engine/distributed/shm_collectives.py)
    adaptive: bool = False  # adaptive k: the group's k from the ranks' votes; like dynamic k, tokens must match only


def _prompts():
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    return [json_schema_prompt(row["schema"]) for row in heldout_cases()[:6]]


def _cases() -> list[Case]:
    p = _prompts()
    long_prompt = " ".join(p[:4])  # a few hundred tokens: several chunks at 64 tokens per step
    return [
        Case("plain", (Req(0, p[0]), Req(1, p[1]), Req(0, p[2]))),
        Case("mtp", (Req(0, p[0]), Req(1, p[1]), Req(0, p[2])), method="mtp"),
        Case("eagle3", (Req(0, p[0]), Req(1, p[1]), Req(0, p[2])), method="eagle3"),
        Case("rank1_idle_throughout", (Req(0, p[0]), Req(0, p[3]), Req(0, p[4])), method="mtp"),
        Case("unequal_and_late", (Req(0, p[0], 40), Req(0, p[1], 40), Req(0, p[2], 40), Req(0, p[3], 40),
                                  Req(1, p[4], 3), Req(1, p[5], 8, start_step=12)), method="mtp"),
        Case("chunked_prefill_beside_decode", (Req(1, p[1], 30), Req(0, long_prompt, 12, start_step=3)),
             method="eagle3", engine={"max_num_batched_tokens": 64}),
        Case("guided", (Req(0, p[0], 60, guided=True), Req(1, p[1], 60, guided=True), Req(1, p[2])),
             method="mtp"),
        Case("sampled", (Req(0, p[0], temperature=0.8), Req(1, p[1], temperature=0.8)), method="mtp"),
        Case("all_reduce_exchange", (Req(0, p[0]), Req(1, p[1])), exchange="all_reduce"),
        Case("graph_layout_with_idle_rank", (Req(0, p[0], 30), Req(0, p[1], 30), Req(0, p[2], 30),
                                             Req(1, p[3], 6), Req(1, p[4], 10, start_step=14)),
             method="mtp", padded=True),
        Case("dynamic_k", (Req(0, p[0], 30), Req(1, p[1], 30), Req(1, p[2], 10), Req(0, p[3], 20, start_step=4)),
             method="mtp", dynamic_k=(2, 4)),
        Case("mtp_shm", (Req(0, p[0]), Req(1, p[1]), Req(0, p[2])), method="mtp", shm=True),
        Case("adaptive_k", (Req(0, p[0], 48), Req(1, p[1], 48), Req(1, p[2], 20), Req(0, p[3], 30, start_step=5),
                            Req(1, p[4], 60, guided=True)), method="mtp", adaptive=True),
        Case("unequal_and_late_shm", (Req(0, p[0], 40), Req(0, p[1], 40), Req(1, p[4], 3),
                                      Req(1, p[5], 8, start_step=12)), method="eagle3", shm=True),
        Case("all_reduce_exchange_shm", (Req(0, p[0]), Req(1, p[1], temperature=0.8)), exchange="all_reduce",
             shm=True),
    ]


def _config(root: str, case: Case, **overrides) -> EngineConfig:
    spec = None
    if case.method is not None:
        spec = SpecConfig(method=case.method, k=3, draft=f"{root}/{case.method}", dynamic_k=case.dynamic_k,
                          adaptive_k=case.adaptive)
    return EngineConfig(model=f"{root}/target", num_kv_blocks=256, block_size=16, speculative=spec,
                        **case.engine, **overrides)


def _drive(engine: LLMEngine, reqs: list[tuple[str, Req]], group) -> dict:
    return drive(engine, [(rid, r.prompt, r.params(), r.start_step) for rid, r in reqs], group)


def _rank_main(rank: int, port: int, root: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    shm = shm_collectives.connect(dist.distributed_c10d._get_default_store(), "adp/", rank, 2)
    try:
        for case in _cases():
            cfg = _config(root, case, tp_size=2, tp_rank=rank, attention_dp=2, adp_exchange=case.exchange)
            calls = shm.calls if shm is not None else 0
            engine = LLMEngine(cfg, tp_group=dist.group.WORLD, tp_shm=shm if case.shm else None)
            if case.padded:
                engine.runner.use_graphs(8, capture=False, capture_on_demand=False)
            mine = [(f"{case.name}-{i}", r) for i, r in enumerate(case.requests) if r.rank == rank]
            done = _drive(engine, mine, dist.group.WORLD)
            stats = engine.stats()
            k_steps = stats["spec"]["dynamic_k_steps"] if "spec" in stats else None
            if case.padded:  # rank 1 idles through padded steps: both ranks ran the same padded steps
                k_steps = (k_steps, engine.runner.graphs.num_runs)
            shm_calls = (shm.calls - calls) if shm is not None else None
            queue.put((rank, case.name, done, stats["kv_blocks_used"], (engine.kv_cache.shape[4], k_steps, shm_calls)))
    except BaseException as e:  # noqa: BLE001 - reported to the test, which would otherwise wait
        queue.put((rank, "error", repr(e), None, None))
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def adp_results(zoo_dir):
    return run_ranks(_rank_main, (str(zoo_dir),), len(_cases()))


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.name)
def test_adp_equals_one_process(adp_results, zoo_dir, case):
    """Tokens and per-request acceptance of dp=2 equal tp=1 on the same requests; every rank's blocks
    are free afterwards; each rank holds every KV head (whole heads, no slicing)."""
    single = LLMEngine(_config(str(zoo_dir), case))
    reference = _drive(single, [(f"{case.name}-{i}", Req(0, r.prompt, r.max_tokens, 0, r.guided, r.temperature))
                                for i, r in enumerate(case.requests)], None)
    adp = {}
    k_steps = [adp_results[(rank, case.name)][2][1] for rank in range(2)]
    assert k_steps[0] == k_steps[1], f"the ranks chose different k: {k_steps}"  # one decision for the group
    if case.dynamic_k:
        assert sum(k_steps[0][:3]) > 0, k_steps  # the group's batch lowered k
    if case.adaptive:  # the votes moved k (or its exploring steps did), on both ranks alike
        assert sum(n > 0 for n in k_steps[0]) >= 2, k_steps
    if case.padded:
        assert k_steps[0][1] > 10, k_steps  # decode steps ran in the padded layout, on both ranks alike
    for rank in range(2):
        done, used, (heads, _, shm_calls) = adp_results[(rank, case.name)]
        assert used == 0, f"rank {rank} still holds {used} KV blocks"
        if shm_calls is not None:  # an x86 Linux host: the shared mapping carried the shm cases' collectives
            assert (shm_calls > 0) == case.shm, (rank, shm_calls)
        assert heads == single.model_cfg.num_kv_heads
        owned = {f"{case.name}-{i}" for i, r in enumerate(case.requests) if r.rank == rank}
        assert set(done) == owned, (rank, sorted(done), sorted(owned))
        adp.update(done)
    for rid, (tokens, accepted) in reference.items():
        assert adp[rid][0] == tokens, rid
        if case.method is not None and not case.dynamic_k and not case.adaptive:
            assert adp[rid][1] == accepted, f"{rid}: acceptance with ADP {adp[rid][1]} vs without {accepted}"


def test_group_plan_pads_to_the_largest_rank_and_replays_graphs_together():
    """The agreement is a pure function of the gathered table: every rank derives the same plan."""
    plan = GroupPlan.from_table([[4, 1, 1, 1], [0, 0, 0, 0], [12, 3, 1, 4]])
    assert plan.forward and plan.max_tokens == 12 and plan.total_requests == 4
    assert plan.graph and plan.graph_batch == 4  # the idle rank replays an all-padding batch of 4
    mixed = GroupPlan.from_table([[4, 1, 1, 1], [7, 1, 0, 0]])  # a prompt chunk on rank 1: nobody replays
    assert not mixed.graph and mixed.graph_batch == 0 and mixed.max_tokens == 7
    idle = GroupPlan.from_table([[0, 0, 0, 0], [0, 0, 0, 0]])
    assert not idle.forward and not idle.graph


def test_attention_dp_must_cover_the_group():
    with pytest.raises(ValueError, match="attention_dp"):
        EngineConfig(model="unused", tp_size=4, attention_dp=2)


def test_dynamic_k_steps_down_with_the_batch_and_stays_lossless(zoo_dir):
    """Dynamic k (SpecConfig.dynamic_k) verifies fewer drafts as the batch grows; outputs stay equal to
    fixed k (both are lossless), and the steps it chose are counted."""
    prompts = _prompts()[:4]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    spec = dict(method="mtp", k=3, draft=f"{zoo_dir}/mtp")
    outs = {}
    for name, dynamic in (("fixed", ()), ("dynamic", (2, 3, 4))):
        # Without prefix caching: the prompts share their template's first blocks, so with it the later ones wait
        # for the first one's (in-batch sharing) and the batch is not 4 from the first step, which this test needs.
        engine = LLMEngine(EngineConfig(model=f"{zoo_dir}/target", num_kv_blocks=256, enable_prefix_caching=False,
                                        speculative=SpecConfig(**spec, dynamic_k=dynamic)))
        outs[name] = _drive(engine, [(str(i), Req(0, p, 16)) for i, p in enumerate(prompts)], None)
        outs[name + "_stats"] = engine.stats()["spec"]
    assert {r: t for r, (t, _) in outs["dynamic"].items()} == {r: t for r, (t, _) in outs["fixed"].items()}
    steps = outs["dynamic_stats"]["dynamic_k_steps"]
    assert steps[0] > 0 and steps[3] == 0  # 4 running requests: k=0 while all run, never the full k
    assert outs["fixed_stats"]["dynamic_k_steps"] == [0, 0, 0, 0]
    assert SpecConfig(**spec, dynamic_k=(16, 32, 64)).k_for(20) == 2
    with pytest.raises(ValueError, match="dynamic_k"):
        SpecConfig(**spec, dynamic_k=(8, 4))
