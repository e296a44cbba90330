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
    assert sorted(cost._probe) == [1, 2, 4, 8]
    for times in cost._probe.values():
        assert len(times) == 4 and all(t > 0 for t in times)
        assert times == sorted(times)  # monotone in k
    # before any step is timed, the table is the probe's own ratios
    probe = cost._probe[8]
    assert cost.table(8) == pytest.approx([min(t / probe[0], A.MAX_COST) for t in probe[1:]])


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


def test_measured_steps_scale_the_prices_of_the_k_not_measured():
    """The probe times the step function alone; real steps add host work and attend over real contexts. The
    probe's prices are scaled to the measured k's: a k never measured is priced in proportion to one that was."""
    cost = _probed([0.010, 0.020, 0.030, 0.040])
    assert cost.table(16) == pytest.approx([2.0, 3.0, 4.0])
    for _ in range(A.WINDOW):
        cost.observe(16, 3, 0.080)  # k = 3 alone measured, twice the probe's price: the ratios stay the probe's
    assert cost.table(16) == pytest.approx([2.0, 3.0, 4.0])
    for _ in range(A.WINDOW):  # k = 0 measured too, at 30 ms: host work the probe missed
        cost.observe(16, 0, 0.030)
    scale = (A.WINDOW * 0.080 + A.WINDOW * 0.030) / (A.WINDOW * 0.040 + A.WINDOW * 0.010)
    est0 = (A.WINDOW * 0.030 + A.LINE_WEIGHT * 0.010 * scale) / (A.WINDOW + A.LINE_WEIGHT)
    est3 = (A.WINDOW * 0.080 + A.LINE_WEIGHT * 0.040 * scale) / (A.WINDOW + A.LINE_WEIGHT)
    table = cost.table(16)
    assert table[0] == pytest.approx(0.020 * scale / est0) and table[2] == pytest.approx(est3 / est0)
    assert table[2] < 3.0  # the host share measured at both ends brings the ratio down from the probe's 4


def test_a_batch_between_probed_sizes_reads_the_line_between_them():
    """A bucket spans batches up to twice its smallest: at batch 14 a k = 3 step's 56 rows cost nearly twice batch
    8's 32. The prices come from the probed sizes around the batch."""
    cost = A.StepCost(3)
    cost.set_probe({8: [0.028, 0.042, 0.134, 0.165], 16: [0.040, 0.173, 0.217, 0.255]})
    want = [(0.25 * lo + 0.75 * hi) for lo, hi in zip([0.028, 0.042, 0.134, 0.165], [0.040, 0.173, 0.217, 0.255])]
    assert cost.table(14) == pytest.approx([t / want[0] for t in want[1:]])
    assert cost.table(8) == pytest.approx([0.042 / 0.028, 0.134 / 0.028, 0.165 / 0.028])
    assert cost.table(40) == pytest.approx([0.173 / 0.040, 0.217 / 0.040, 0.255 / 0.040])  # past the last: the last


def test_a_stalled_plain_step_does_not_make_drafts_look_free():
    """Batch 14, guided JSON on SmolLM2 (bench/results/real_spec_probe_b16_cpu.md): one plain step took 3.4 s (a
    stall) among 60 ms ones, k = 3 ran 15 steps at 383 ms. Read as k = 0's time, the stall priced every k at a plain
    step and the engine verified 3 drafts at batch 14. A k needs MIN_OWN steps to be its own median; below, the
    prices scaled to the measured k's."""
    cost = A.StepCost(3)
    cost.set_probe({8: [0.028, 0.042, 0.134, 0.165], 16: [0.040, 0.173, 0.217, 0.255]})
    cost.observe(14, 0, 3.4)
    for _ in range(A.WINDOW):
        cost.observe(14, 3, 0.383)
    table = cost.table(14)
    assert table[2] > 5.0
    gain = tuple(round(g * 14 * A.SCALE) for g in (0.9, 1.7, 2.4))
    assert A.decide(14, gain, tuple(round(c * A.SCALE) for c in table), 3) == 0
    for _ in range(A.MIN_OWN - 1):  # plain steps as they really are: k = 0's own median from now on
        cost.observe(14, 0, 0.060)
    assert cost.table(14)[2] == pytest.approx(cost.table(14)[2]) and cost.table(14)[2] > 5.0
