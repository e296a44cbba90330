"""Tree nodes scored by estimated acceptance (engine/speculative/tree_score.py): the table's lookups and updates,
a verification's outcome per node against a walk done by hand, and in the engine: every accepted draft counted
once as a hit, outputs equal to no speculation with either scoring rule."""
from __future__ import annotations

import math
import pytest
import torch

from engine import LLM, SamplingParams, SpecConfig, StructuredOutput
from engine.speculative.tree_score import MAX_TRIALS, NUM_BUCKETS, PRIOR_TRIALS, AcceptanceTable
from kernels.tree_outcome import outcome


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def test_an_untrained_table_scores_as_the_head_and_leaves_forced_and_refused_alone():
    table = AcceptanceTable(topk=2, device=torch.device("cpu"))
    lp = torch.tensor([[math.log(0.9), math.log(0.05), 0.0, float("-inf")]])
    cells = table.cells(lp, torch.tensor([0, 1, 0, 1]), torch.tensor([False]), torch.tensor([False]))
    assert cells[0, 2] == -1 and cells[0, 3] == -1  # forced, refused: not estimated
    score = table.score(lp, cells)
    centre = lambda p: (int(p * NUM_BUCKETS) + 0.5) / NUM_BUCKETS  # noqa: E731
    assert score[0, 0].item() == pytest.approx(math.log(centre(0.9)), rel=1e-5)
    assert score[0, 1].item() == pytest.approx(math.log(centre(0.05)), rel=1e-5)
    assert score[0, 2].item() == 0.0 and math.isinf(score[0, 3].item())
    # classes of their own: a sampled request's candidates, a masked row's
    sampled = table.cells(lp[:, :2], torch.tensor([0, 1]), torch.tensor([True]), torch.tensor([False]))
    assert (sampled - cells[:, :2]).tolist() == [[2 * 2 * NUM_BUCKETS] * 2]
    masked = table.cells(lp[:, :2], torch.tensor([0, 1]), torch.tensor([False]), torch.tensor([[True, False]]))
    assert (masked - cells[:, :2]).tolist() == [[2 * NUM_BUCKETS, 0]]


def test_observations_move_the_estimate_and_old_ones_fade():
    table = AcceptanceTable(topk=2, device=torch.device("cpu"))
    lp = torch.tensor([[math.log(0.3), math.log(0.3)]])
    # rank 0 and rank 1, same probability
    cells = table.cells(lp, torch.tensor([0, 1]), torch.tensor([False]), torch.tensor([False]))
    for _ in range(40):  # the best candidate always accepted, its sibling never
        table.observe(cells, torch.tensor([[True, True]]), torch.tensor([[True, False]]))
    table.observe(cells, torch.tensor([[False, False]]), torch.tensor([[False, False]]))  # not reached: no trial
    rates = table.rates()[0, :, int(0.3 * NUM_BUCKETS)]
    prior = (int(0.3 * NUM_BUCKETS) + 0.5) / NUM_BUCKETS
    assert rates[0].item() == pytest.approx((prior * PRIOR_TRIALS + 40) / (PRIOR_TRIALS + 40))
    assert rates[1].item() == pytest.approx(prior * PRIOR_TRIALS / (PRIOR_TRIALS + 40))
    score = table.score(lp, cells)
    assert score[0, 0] > math.log(0.85) and score[0, 1] < math.log(0.06)
    for _ in range(int(MAX_TRIALS)):  # now the other way round: the cap lets the new rate take over
        table.observe(cells, torch.tensor([[True, True]]), torch.tensor([[False, True]]))
    assert table.trials.max().item() <= MAX_TRIALS + 1e-3
    rates = table.rates()[0, :, int(0.3 * NUM_BUCKETS)]
    assert rates[0].item() < 0.4 and rates[1].item() > 0.6


def test_outcome_marks_the_reached_and_the_accepted_nodes():
    # root -> {1, 2}; 1 -> {3}; 2 -> {4}; 3 -> {5}; accepted path 0 -> 1 -> 3, then the walk stopped
    parents = torch.tensor([[0, 0, 1, 2, 3], [0, 0, 1, 2, 3], [0, 0, 1, 2, 3]])
    path = torch.tensor([[0, 1, 3, 3], [0, 0, 0, 0], [0, 2, 4, 4]])
    reached, accepted = outcome(path, parents, torch.tensor([5, 5, 3]))
    assert reached.tolist() == [[True, True, True, False, True], [True, True, False, False, False],
                                [True, True, False, False, False]]  # request 2 had 3 nodes: 4 and 5 never ran
    assert accepted.tolist() == [[True, False, True, False, False], [False] * 5,
                                 [False, True, False, False, False]]


@pytest.fixture(scope="module")
def prompts():
    return ["Write a short poem about the sea.", "List three colors.", "Explain what a tree is.",
            "The capital of France is"]


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def params() -> list[SamplingParams]:
    """Three free requests and a guided one (its rows are masked: the table's masked classes)."""
    free = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in range(3)]
    return free + [SamplingParams(max_tokens=24, temperature=0, structured_output=StructuredOutput(json_schema=SCHEMA))]


@pytest.fixture(scope="module")
def reference(zoo, prompts):
    llm = LLM(str(zoo / "target"), num_kv_blocks=512, block_size=16)
    return [o.token_ids for o in llm.generate(prompts, params())]


@pytest.mark.parametrize("rule", ["calibrated", "draft"])
def test_engine_learns_from_every_verification_and_emits_the_same_tokens(zoo, prompts, reference, rule):
    spec = SpecConfig(method="mtp", k=4, draft=str(zoo / "mtp"), topk=2, num_verify_tokens=6, tree_score=rule)
    llm = LLM(str(zoo / "target"), num_kv_blocks=512, block_size=16, speculative=spec)
    table = llm.engine.runner.proposer.tree_table if rule == "calibrated" else None
    assert (table is None) == (rule == "draft")
    hits0 = table.hits.sum().item() if table is not None else 0.0
    free = llm.generate(prompts[:3], params()[:3])
    accepted = sum(o.metrics.num_accepted_tokens for o in free)
    assert accepted > 0
    if table is not None:  # each accepted node is one hit (no grammar: no forced nodes, which are never scored)
        assert table.hits.sum().item() - hits0 == pytest.approx(accepted, abs=1e-2)
        assert (table.trials[0] - PRIOR_TRIALS).sum() > accepted  # the free greedy class only
        assert (table.trials[1:] == PRIOR_TRIALS).all()
    guided = llm.generate(prompts[3:], params()[3:])
    assert [o.token_ids for o in free + guided] == reference
    assert llm.engine.blocks.pool.num_used == 0
    if table is not None:
        assert (table.trials[1] - PRIOR_TRIALS).sum() > 0  # the grammar's masked rows: a class of their own
