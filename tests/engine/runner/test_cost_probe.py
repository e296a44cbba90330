"""Adaptive k's start-up cost probe (engine/runner/cost_probe.py) and the cost table that starts from it
(engine/speculative/adaptive.py, StepCost): the probe runs every method's step shapes without touching a request's
KV, and the table reads a k not measured lately from it. Timing values are not asserted (tests check
correctness): the table's arithmetic is tested on given times."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SpecConfig
from engine.runner.cost_probe import probe_sizes, probe_step_costs
from engine.speculative import adaptive as A
from tests.support.spec import greedy_params, random_prompts, spec_config, use_graphs


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def test_probe_sizes_cover_every_bucket_up_to_the_largest_batch():
    assert probe_sizes(1) == [1]
    assert probe_sizes(16) == [1, 2, 4, 8, 16]
    assert probe_sizes(24) == [1, 2, 4, 8, 16, 24]
    buckets = {A.StepCost.bucket(s) for s in probe_sizes(64)}
    assert buckets == {A.StepCost.bucket(b) for b in range(1, 65)}


def _adaptive_llm(llama_dir, spec_drafts, method, **kw):
    spec = spec_config(method, 3, spec_drafts, llama_dir)
    return LLM(llama_dir, num_kv_blocks=256, block_size=4, max_num_seqs=8,
               speculative=SpecConfig(method=spec.method, k=3, draft=spec.draft, adaptive_k=True, **kw))


@pytest.mark.parametrize("method", ["mtp", "eagle3", "ngram", "draft_model"])
def test_the_engine_probes_every_bucket_and_k_at_start(llama_dir, spec_drafts, method):
    llm = _adaptive_llm(llama_dir, spec_drafts, method)
    cost = llm.engine.drafter.adaptive.cost
    assert sorted(cost._probe) == [A.StepCost.bucket(s) for s in (1, 2, 4, 8)]
    for times in cost._probe.values():
        assert len(times) == 4 and all(t > 0 for t in times)
    # before any step is timed, the table is the probe's own ratios
    probe = cost._probe[A.StepCost.bucket(8)]
    assert cost.table(8) == pytest.approx([min(max(t / probe[0], 1 / A.MAX_COST), A.MAX_COST) for t in probe[1:]])


@pytest.mark.parametrize("graphs", [False, True])
def test_the_probe_writes_no_requests_kv_and_outputs_stay_lossless(llama_dir, spec_drafts, graphs):
    """Idle rows write no KV: a probe run between two requests' steps leaves the cache as it was, and the
    engine's greedy tokens equal no speculation (through the padded graph layout too)."""
    prompts = random_prompts(4, seed=5)
    want = [o.token_ids for o in LLM(llama_dir, num_kv_blocks=256, block_size=4).generate(prompts, greedy_params(20))]
    llm = _adaptive_llm(llama_dir, spec_drafts, "mtp")
    if graphs:
        use_graphs(llm, capture=False)
    llm.generate(prompts[:2], greedy_params(8))
    before = llm.engine.kv_cache.clone()
    probed = probe_step_costs(llm.engine.runner, 8, repeats=1)
    assert set(probed) == {1, 2, 4, 8}
    assert torch.equal(before, llm.engine.kv_cache)
    assert [o.token_ids for o in llm.generate(prompts, greedy_params(20))] == want


def test_cost_probe_off_leaves_the_line_prior(llama_dir, spec_drafts):
    llm = _adaptive_llm(llama_dir, spec_drafts, "mtp", cost_probe=False)
    cost = llm.engine.drafter.adaptive.cost
    assert cost._probe == {} and cost.table(4) == pytest.approx([1.2, 1.4, 1.6])


def _probed(times: list[float], batch: int = 16) -> A.StepCost:
    cost = A.StepCost(len(times) - 1)
    cost.set_probe({batch: times})
    return cost


def test_a_draft_the_probe_prices_dear_is_not_run_from_the_first_step():
    """At batch 16 on a 2-core CPU a k = 1 step's 32 rows leave the compiled 16-row forward: ~3.6 plain steps. The
    line prior (1.2) sent the first steps to k = 1; the probe's table keeps them at 0."""
    cost = _probed([0.010, 0.036, 0.040, 0.045])
    gain = tuple(round(g * 16 * A.SCALE) for g in (0.7, 1.2, 1.5))  # accepted drafts per request at k = 1..3
    table = tuple(round(c * A.SCALE) for c in cost.table(16))
    assert A.decide(16, gain, table, 3) == 0
    assert A.decide(16, gain, A.linear_cost(3), 3) > 0
    # a cheap draft (batch 1: the rows stay in one bucket) is still taken
    cheap = _probed([0.010, 0.011, 0.012, 0.013], batch=1)
    assert A.decide(1, (700, 1200, 1500), tuple(round(c * A.SCALE) for c in cheap.table(1)), 3) == 3


def test_measured_plain_steps_carry_the_host_share_the_probe_misses():
    """The probe times the step function; a real step adds host work (the same at every k). The table adds the
    probe's differences to the measured plain step, so the ratios shrink toward what real steps show."""
    cost = _probed([0.010, 0.020, 0.030, 0.040])
    assert cost.table(16) == pytest.approx([2.0, 3.0, 4.0])
    for _ in range(A.WINDOW):
        cost.observe(16, 0, 0.020)  # 10 ms of host work per step
    assert cost.table(16) == pytest.approx([1.5, 2.0, 2.5])
    for _ in range(A.WINDOW):  # k = 2 measured: its own median, shrunk toward the probe's price by LINE_WEIGHT
        cost.observe(16, 2, 0.028)
    # the plain step's estimate now also reads k = 2's steps less what the probe says k = 2 adds (20 ms): 8 ms
    plain = max((A.WINDOW * 0.020 + A.WINDOW * 0.008) / (2 * A.WINDOW), 0.005)
    est2 = (A.WINDOW * 0.028 + A.LINE_WEIGHT * (plain + 0.020)) / (A.WINDOW + A.LINE_WEIGHT)
    est0 = (A.WINDOW * 0.020 + A.LINE_WEIGHT * plain) / (A.WINDOW + A.LINE_WEIGHT)
    assert cost.table(16)[1] == pytest.approx(est2 / est0)
    # other buckets are the probe's alone
    assert _probed([0.01, 0.02, 0.03, 0.04], batch=4).table(5) == pytest.approx([2.0, 3.0, 4.0])


def test_a_stalled_plain_step_is_forgotten_within_a_few():
    """A stall among the plain steps (a first call, another job's burst) is one sample of k = 0's median: two
    normal steps outvote it, and the table is what they alone give. Drafts never look cheaper than a plain step."""
    cost = _probed([0.010, 0.020, 0.030, 0.040])
    cost.observe(16, 0, 0.100)
    assert all(c >= 1.0 for c in cost.table(16))
    cost.observe(16, 0, 0.020)
    cost.observe(16, 0, 0.020)
    assert cost.table(16) == pytest.approx([1.5, 2.0, 2.5])
