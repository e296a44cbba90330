"""Draft trees (SpecConfig(topk > 1), engine/speculative/tree_step.py) under tensor parallelism (tp=2: attention
heads, the head's layer and the MLP sharded, every rank running the whole batch) and attention data parallelism
(ADP=2: each rank its own requests, the MLP's rows exchanged, an idle rank's forward matching the busy rank's
collectives while it drafts nothing) over gloo in two processes; tp=2 with async scheduling too (step N+1 planned
before step N is read: its requests' trees are carried from N's outputs on the device, engine/runner/overlap.py).

Each case's tokens equal one process WITHOUT speculation (trees are lossless: greedy, guided and seeded sampled
outputs are bit for bit the plain sampler's), and each request's accepted lengths equal one process running the
same tree config: the group drafted the same trees and verified them the same way as one rank would. That holds
for nodes ranked by the learned acceptance table too (SpecConfig.tree_score="calibrated", the default): tp ranks see
the same verifications, and ADP ranks, idle ones included, learn from the group's gathered outcomes, so every
rank's table is the one process's. ADP cases marked `padded` run their decode steps through the padded graph layout
(without capture here: the same static buffers and fixed shapes a GPU captures), where the outcomes' all-gather pads
to the graph's batch. Every KV block and draft-state slot is free at the end. One pair of processes runs every case
(spawning is the slow part).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

from engine import EngineConfig, LLMEngine, SamplingParams, SpecConfig
from structured.request import StructuredOutput

from tests.support.ranks import drive, run_ranks

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@dataclass(frozen=True)
class Req:
    rank: int  # the ADP rank that owns it (under plain tp every rank runs every request)
    prompt: int  # index into _prompts()
    max_tokens: int = 16
    start_step: int = 0  # added once the group has run this many steps
    guided: bool = False
    temperature: float = 0.0

    def params(self) -> SamplingParams:
        so = StructuredOutput(json_schema=SCHEMA) if self.guided else None
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, seed=11,
                              ignore_eos=not self.guided, structured_output=so)


@dataclass(frozen=True)
class Case:
    name: str
    requests: tuple[Req, ...]
    adp: bool  # attention_dp=2 (else plain tp=2)
    method: str = "mtp"
    topk: int = 2
    nodes: int = 5  # num_verify_tokens
    score: str = "calibrated"  # SpecConfig.tree_score
    ahead: bool = False  # async scheduling: step N+1 launched before step N is read, its trees carried on the device
    # ADP: decode steps take the padded graph layout (run eagerly: capture=False), graphs of greedy batches held at
    # every size as under ADP on a GPU; the outcomes' all-gather then pads to the graph's batch, not the agreement's
    padded: bool = False
    engine: dict = field(default_factory=dict)
    model: str | None = None  # a named model (zoo/models.py) drafting with its own MTP layer; None: the zoo's writer


CASES = [
    Case("tp_mtp", (Req(0, 0), Req(0, 1, 10), Req(0, 2, 12, start_step=3)), adp=False),
    Case("tp_mtp_async", (Req(0, 0), Req(0, 1, 10), Req(0, 2, 14, temperature=0.8), Req(0, 3, 12, start_step=3)),
         adp=False, ahead=True),
    # guided under plain tp: each rank compiles the grammar on its own thread, and the ranks agree on when it is
    # ready (engine/masking/guided.py agree), or they would sample it in different steps (a collective mismatch;
    # chains too). Nodes by draft probability: see adp_guided_sampled.
    Case("tp_guided", (Req(0, 0, 40, guided=True), Req(0, 1, 12), Req(0, 3, 40, guided=True, start_step=2)),
         adp=False, topk=3, nodes=6, score="draft"),
    Case("tp_eagle3_sampled", (Req(0, 0), Req(0, 1, temperature=0.8)), adp=False, method="eagle3", topk=3,
         nodes=6),
    Case("adp_mtp_draft_scores", (Req(0, 0), Req(1, 1), Req(0, 2, 10)), adp=True, score="draft"),
    # rank 1 idles for the first steps, runs a short request, idles again while rank 0 goes on (unequal loads); in
    # the padded layout, an idle rank running a batch of padding only
    Case("adp_idle_then_late", (Req(0, 0, 24), Req(0, 1, 24), Req(1, 2, 4, start_step=5)), adp=True, padded=True),
    # three requests on rank 0 pad to a graph batch of 4, more than any rank runs: the outcomes gathered are 4 rows
    # a rank, and every rank's acceptance table still learns exactly what one process learns
    Case("adp_padded_past_requests", (Req(0, 0, 16), Req(0, 1, 12), Req(0, 2, 14), Req(1, 3, 10, start_step=2)),
         adp=True, padded=True),
    # rank 0 prefills a long prompt in chunks while rank 1 verifies trees
    Case("adp_chunked_prefill_beside_trees", (Req(1, 1, 20), Req(0, 5, 6, start_step=2)), adp=True,
         engine={"max_num_batched_tokens": 64}),
    # expansion and verification masked by the grammar on both ranks; a seeded sampled request beside them. Nodes
    # ranked by draft probability: a guided request samples first in the step after its grammar compiled (wall-clock
    # time), and a learned table would carry that timing into the other requests' trees.
    Case("adp_guided_sampled", (Req(0, 0, 40, guided=True), Req(1, 1, 40, guided=True), Req(1, 2, temperature=0.8)),
         adp=True, topk=3, nodes=6, score="draft"),
    # an MLA + MoE target (the DeepSeek family's layout, where ADP matters: its latent KV cannot shard), drafting
    # with its own MTP layer; rank 1 samples
    Case("adp_mla", (Req(0, 0, 12), Req(1, 1, 12, temperature=0.8), Req(0, 2, 8, start_step=2)), adp=True,
         model="tandem-tiny-moe"),
]


def _prompts() -> list[str]:
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    p = [json_schema_prompt(row["schema"]) for row in heldout_cases()[:5]]
    return p + [" ".join(p[:3])]  # the last: a few hundred tokens, several 64-token chunks


def _config(root: str, case: Case | None, spec: bool, **overrides) -> EngineConfig:
    model, draft = f"{root}/target", f"{root}/{case.method}"
    if case.model is not None:
        from zoo.models import resolve

        model, draft = str(resolve(case.model).target), None  # its MTP layer is in the target's directory
    s = None
    if spec:
        s = SpecConfig(method=case.method, k=3, draft=draft, topk=case.topk, num_verify_tokens=case.nodes,
                       tree_score=case.score)
    return EngineConfig(model=model, num_kv_blocks=256, block_size=16, speculative=s,
                        **(case.engine if case is not None else {}), **overrides)


def _drive(engine: LLMEngine, reqs: list[tuple[str, Req]], prompts: list[str], group) -> dict:
    return drive(engine, [(rid, prompts[r.prompt], r.params(), r.start_step) for rid, r in reqs], group)


def _rank_main(rank: int, port: int, root: str, queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    prompts = _prompts()
    try:
        for case in CASES:
            cfg = _config(root, case, True, tp_size=2, tp_rank=rank, attention_dp=2 if case.adp else 1,
                          async_scheduling=case.ahead)
            engine = LLMEngine(cfg, tp_group=dist.group.WORLD)
            if case.padded:
                engine.runner.use_graphs(8, capture=False, capture_on_demand=False)
            mine = [(f"{case.name}-{i}", r) for i, r in enumerate(case.requests) if not case.adp or r.rank == rank]
            done = _drive(engine, mine, prompts, dist.group.WORLD)
            queue.put((rank, case.name, done, (engine.stats()["kv_blocks_used"], engine.drafter.num_held),
                       (engine.num_overlapped_steps, _table(engine), _padded_runs(engine))))
    except BaseException as e:  # noqa: BLE001 - reported to the test, which would otherwise wait
        queue.put((rank, "error", repr(e), None, None))
        raise
    finally:
        dist.destroy_process_group()


def _table(engine: LLMEngine) -> list | None:
    """The acceptance table's estimates (tree_score="calibrated"; None for draft scores), as lists: a tensor put
    on the queue travels as a shared-memory handle that dies with its process, hiding a later case's error."""
    table = engine.drafter.proposer.tree_table
    return table.rates().tolist() if table is not None else None


def _padded_runs(engine: LLMEngine) -> int | None:
    """Steps that took the padded graph layout (None: the engine runs every step eagerly)."""
    graphs = engine.runner.graphs
    return graphs.num_runs if graphs is not None else None


@pytest.fixture(scope="module")
def group_results(zoo_dir):
    return run_ranks(_rank_main, (str(zoo_dir),), len(CASES))


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_trees_in_a_group_equal_one_process(group_results, zoo_dir, case):
    prompts = _prompts()
    reqs = [(f"{case.name}-{i}", r) for i, r in enumerate(case.requests)]
    plain = _drive(LLMEngine(_config(str(zoo_dir), case, False)), reqs, prompts, None)
    alone = LLMEngine(_config(str(zoo_dir), case, True))
    tree = _drive(alone, reqs, prompts, None)
    if case.ahead:  # one process planning ahead too: the same tokens and trees as its synchronous steps
        ahead = LLMEngine(_config(str(zoo_dir), case, True, async_scheduling=True))
        assert _drive(ahead, reqs, prompts, None) == tree and ahead.num_overlapped_steps > 0
    got, runs = {}, []
    for rank in range(2):
        done, (used, slots), (overlapped, table, padded) = group_results[(rank, case.name)]
        runs.append(padded)
        assert (used, slots) == (0, 0), f"rank {rank} still holds {used} KV blocks and {slots} draft slots"
        assert (overlapped > 0) == case.ahead, (rank, overlapped)
        if case.score == "calibrated":  # every rank, an idle one too, learned what one process learned
            assert table == _table(alone), (rank, table, _table(alone))  # exact: the same floats
        owned = {rid for rid, r in reqs if not case.adp or r.rank == rank}
        assert set(done) == owned, (rank, sorted(done), sorted(owned))
        for rid, out in done.items():  # under plain tp both ranks emit every request: the same
            assert got.setdefault(rid, out) == out, f"{rid}: the tp ranks disagree"
    for rid, (tokens, _) in plain.items():
        assert got[rid][0] == tokens, f"{rid}: not the output without speculation"
        assert got[rid][1] == tree[rid][1], f"{rid}: acceptance {got[rid][1]} in the group, {tree[rid][1]} alone"
    assert sum(sum(a) - len(a) for _, a in tree.values()) > 0  # the trees accepted drafts
    if case.padded:  # the ranks took the padded layout together (an idle rank with a batch of padding only)
        assert runs[0] == runs[1] and runs[0] > 2, runs

