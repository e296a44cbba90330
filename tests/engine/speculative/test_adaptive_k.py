"""Acceptance-driven k (SpecConfig.adaptive_k, engine/speculative/adaptive.py): the decision rule against a
brute-force reference, the acceptance estimate per depth and grammar class, the cost fit, and in the engine:
greedy outputs identical to no speculation while k moves, a target drafting for itself keeps the full k, and
a draft that is never accepted brings k down to 0. (ADP agreement: tests/engine/distributed/test_attention_dp.py.)"""
from __future__ import annotations

import pytest

from engine import LLM, SpecConfig
from engine.speculative import adaptive as A
from tests.support.spec import greedy_params, random_prompts, spec_config, use_graphs


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _reference_decide(batch: int, gain: tuple[int, ...], cost: tuple[int, ...], k_max: int) -> int:
    """argmax over k of (batch + G(k)) / c(k) in exact fractions, smallest k among ties."""
    from fractions import Fraction

    rates = [Fraction(batch * A.SCALE + (gain[k - 1] if k else 0), cost[k - 1] if k else A.SCALE)
             for k in range(k_max + 1)]
    return rates.index(max(rates))


def _line(rho: int, k: int) -> tuple[int, ...]:
    return tuple(A.SCALE + rho * j for j in range(1, k + 1))


@pytest.mark.parametrize("batch", [1, 3, 16, 64])
@pytest.mark.parametrize("rho", [0, 50, 200, 700, 1500])
def test_decide_equals_the_reference(batch, rho):
    for per_depth in ((0.9, 0.8, 0.7), (0.5, 0.3, 0.1), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), (0.45, 0.44, 0.44, 0.9)):
        gain, total, through = [], 0.0, 1.0
        for p in per_depth:
            through *= p
            total += through
            gain.append(round(total * batch * A.SCALE))
        # a line, and a table whose first draft position costs most (a draft pass's fixed part)
        for cost in (_line(rho, len(gain)), tuple(A.SCALE + rho + 100 * j for j in range(len(gain)))):
            for k_max in range(len(gain) + 1):
                assert (A.decide(batch, tuple(gain), cost, k_max)
                        == _reference_decide(batch, tuple(gain), cost, k_max))


def test_decide_keeps_the_current_k_unless_another_is_clearly_better():
    """rate(k) = (1 + G(k)) / (1 + 0.2 k); k=1 gives 1.5 / 1.2 = 1.25 throughout."""
    assert A.decide(1, (500, 780), _line(200, 2), 2) == 2  # 1.78 / 1.4 = 1.271: 1.7% better ...
    assert A.decide(1, (500, 780), _line(200, 2), 2, current=1) == 1  # ... not enough to leave k=1
    assert A.decide(1, (500, 850), _line(200, 2), 2, current=1) == 2  # 1.321: 5.7% better, it moves
    assert A.decide(1, (500, 700), _line(200, 2), 2, current=2) == 2  # 1.214: k=1 2.9% better, it stays
    assert A.decide(1, (500, 650), _line(200, 2), 2, current=2) == 1  # 1.179: k=1 6% better, it moves
    assert A.decide(1, (500, 850), _line(200, 2), 1, current=2) == 1  # a current k above the bound does not hold


def test_decide_ties_go_to_the_smaller_k():
    # one draft accepted with p = rho exactly: (1 + p) / (1 + rho) == 1
    assert A.decide(1, (200,), _line(200, 1), 1) == 0
    assert A.decide(1, (201,), _line(200, 1), 1) == 1


def test_acceptance_tracks_depths_classes_and_requests():
    m = A.AcceptanceModel(3)
    assert m.class_rate(A.FREE, 0) == pytest.approx(A.PRIOR[A.FREE][0])
    for _ in range(200):  # "a" accepts its first draft, never its second
        m.observe("a", False, 3, 1, 0)
    assert m.class_rate(A.FREE, 0) > 0.95 and m.class_rate(A.FREE, 1) < 0.05
    assert m.class_rate(A.FREE, 2) == pytest.approx(A.PRIOR[A.FREE][0])  # never reached: the prior
    assert m.class_rate(A.MASKED, 0) == pytest.approx(A.PRIOR[A.MASKED][0])  # another class: untouched
    for _ in range(50):  # "b" accepts everything: its own rate beats the class's
        m.observe("b", False, 3, 3, 0)
    assert m.rate("b", A.FREE, 1) > 0.5 > m.rate("a", A.FREE, 1)
    # forced drafts count for the forced class only, never for the request
    for _ in range(100):
        m.observe("c", True, 3, 0, 0b001)  # its forced first draft rejected (a model writing another tokenization)
    assert m.class_rate(A.FORCED, 0) < 0.2 and m.rate("c", A.MASKED, 0) == pytest.approx(A.PRIOR[A.MASKED][0])
    gains = m.gains("a", False, 0)
    assert gains[0] == pytest.approx(m.rate("a", A.FREE, 0)) and gains[2] - gains[1] < 0.01
    m.forget("a")
    assert m.rate("a", A.FREE, 1) == pytest.approx(m.class_rate(A.FREE, 1))


def test_a_guided_requests_depths_past_its_drafts_are_forced_with_their_share():
    m = A.AcceptanceModel(3)
    for i in range(60):  # "g": its open first draft mostly fails; when it holds, the grammar forces the next two
        if i % 3 == 0:
            m.observe("g", True, 3, 3, 0b110)
        else:
            m.observe("g", True, 3, 0, 0)
    assert m.forced_share("g", 1) > 0.8 and m.forced_share("g", 0) < 0.2
    assert m.forced_share("new", 1) > 0.75  # the rank's share before a request's own
    open_drafts = m.gains("g", True, 0)  # three open drafts in hand
    one_in_hand = m.gains("g", True, 0, known=1)  # one: depths 1 and 2 are likely forced
    assert one_in_hand[0] == open_drafts[0]
    assert one_in_hand[1] - one_in_hand[0] > 1.4 * (open_drafts[1] - open_drafts[0])
    # on a host-bound step's costs, k = 2 looked best from open drafts alone; with the forced share, k = 3
    cost = (1100, 1200, 1300)
    gain = lambda g: tuple(round(x * A.SCALE) for x in g)
    assert A.decide(1, gain(open_drafts), cost, 3) == 2 and A.decide(1, gain(one_in_hand), cost, 3) == 3
    assert m.gains("u", False, 0, known=1) == m.gains("u", False, 0)  # unguided: nothing is forced


def test_decay_brings_an_unobserved_depth_back_to_its_prior():
    m = A.AcceptanceModel(2)
    for _ in range(100):
        m.observe("a", False, 2, 0, 0)
    low = m.class_rate(A.FREE, 0)
    for _ in range(1000):  # DECAY per step: 1000 steps leave 4e-5 of the counts
        m.decay()
    assert low < 0.1 and m.class_rate(A.FREE, 0) == pytest.approx(A.PRIOR[A.FREE][0], abs=0.02)


def test_cost_fit_finds_the_slope_per_batch_bucket():
    c = A.StepCost(3)
    assert c.rho(4) == A.RHO_PRIOR and c.table(4) == pytest.approx([1.2, 1.4, 1.6])
    for i in range(60):
        k = i % 4
        c.observe(4, k, 0.010 * (1 + 0.3 * k))
        c.observe(40, k, 0.050 * (1 + 0.05 * k))
    # the fit, shrunk toward the prior by RHO_PRIOR_WEIGHT against n * Var(k) (about 35 here): close to the truth
    assert 0.28 < c.rho(5) < 0.3 and 0.05 < c.rho(33) < 0.07
    assert c.table(5) == pytest.approx([1.3, 1.6, 1.9], abs=0.02) and c.table(33) == pytest.approx(
        [1.05, 1.1, 1.15], abs=0.02)
    one_k = A.StepCost(3)
    for _ in range(20):
        one_k.observe(1, 3, 0.01)
    assert one_k.rho(1) == A.RHO_PRIOR  # one k only: nothing to fit
    assert one_k.table(1) == pytest.approx([1.2, 1.4, 1.6])  # the prior's shape around what was measured


def test_cost_table_sees_a_draft_pass_fixed_cost_a_line_spreads():
    """Steps at k = 1..3 cost 1.5 / 1.6 / 1.7 plain steps (a draft pass's fixed half step, then 0.1 a position): the
    line through them reads c(1) = 1.1 where k = 0 was never timed, the table near 1.5 once k = 0 was (the exploring
    steps down reach it; each k's mean is still shrunk toward the line), so one draft accepted 40% of the time is no
    longer worth drafting."""
    c = A.StepCost(3)
    for i in range(90):
        k = 1 + i % 3
        c.observe(1, k, 0.010 * (1.4 + 0.1 * k))
    assert c.table(1)[0] < 1.25
    for _ in range(10):
        c.observe(1, 0, 0.010)
    table = c.table(1)
    assert 1.4 < table[0] < 1.5 and table[0] < table[1] < table[2] < 1.75
    vote = A.Vote((400, 500, 550), tuple(round(x * A.SCALE) for x in c.table(1)), 1)
    assert A.decide(1, vote.gain, vote.cost, 3) == 0


def test_one_stalled_step_does_not_price_its_k_out():
    """A step timed at 100x its usual length (the process paused, another job's burst): the medians barely move, and
    the table is back as soon as the stalled step leaves its k's window."""
    c = A.StepCost(3)
    for i in range(80):
        c.observe(1, i % 4, 0.010 * (1 + 0.2 * (i % 4)))
    before = c.table(1)
    c.observe(1, 2, 1.0)
    assert c.table(1) == pytest.approx(before, rel=0.02)
    for i in range(60):
        c.observe(1, i % 4, 0.010 * (1 + 0.2 * (i % 4)))
    assert c.table(1) == pytest.approx(before, rel=1e-6)


def test_a_fresh_engines_slow_first_steps_are_forgotten_within_a_few():
    """First timed steps can pay one-time costs (the first calls of a shape); in a decayed mean they kept their k
    priced out for dozens of steps. Each k's median of its recent steps, and the line through the medians, read the
    true costs after three steps at each k."""
    c = A.StepCost(3)
    for k in (3, 0, 1, 2):  # first steps: 30x slow
        c.observe(1, k, 0.3)
    for i in range(12):
        c.observe(1, i % 4, 0.010 * (1 + 0.2 * (i % 4)))
    assert c.table(1) == pytest.approx([1.2, 1.4, 1.6], rel=0.15)


def test_group_vote_sums_gains_and_takes_the_busy_ranks_largest_cost():
    votes = [A.Vote((500, 700), (1100, 1300), 2), A.Vote((300, 400), (1300, 1200), 1),
             A.Vote((0, 0), (1900, 1900), 0)]
    assert A.group_vote(votes) == A.Vote((800, 1100), (1300, 1300), 3)


@pytest.mark.parametrize("method", ["mtp", "eagle3", "ngram", "draft_model"])
def test_greedy_equals_no_speculation_with_adaptive_k(llama_dir, spec_drafts, method):
    prompts = random_prompts(5, seed=7)
    want = [o.token_ids for o in LLM(llama_dir, num_kv_blocks=512, block_size=4).generate(prompts, greedy_params(24))]
    spec = spec_config(method, 3, spec_drafts, llama_dir)
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4,
              speculative=SpecConfig(method=spec.method, k=3, draft=spec.draft, adaptive_k=True))
    outs = llm.generate(prompts, greedy_params(24))
    assert [o.token_ids for o in outs] == want
    steps = llm.engine.stats()["spec"]["dynamic_k_steps"]
    assert sum(steps) > 0
    for o in outs:  # the counts still add up with k moving
        u = o.speculative
        assert len(o.token_ids) == 1 + u.accepted_tokens + u.verify_steps and u.draft_tokens <= 3 * u.verify_steps


@pytest.mark.parametrize("method", ["mtp", "eagle3", "ngram"])
def test_adaptive_k_through_the_graph_layout_runs_a_graph_per_draft_passes(llama_dir, spec_drafts, method):
    """Graph steps follow adaptive k too: a step at k below the configured one replays the graph of its own number of
    draft passes (captured up front for every count; the CPU runs the padded layout without capture), so a smaller
    k saves the passes it skips, as an eager step does. Tokens equal no speculation."""
    prompts = random_prompts(5, seed=11)
    want = [o.token_ids for o in LLM(llama_dir, num_kv_blocks=512, block_size=4).generate(prompts, greedy_params(40))]
    spec = spec_config(method, 3, spec_drafts, llama_dir)
    # The line prior, which starts at k = 2-3 and moves as the random heads fail: this test is about the graph each k
    # replays, not about pricing (the probe, timed before use_graphs switched the layout, can settle on one k).
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4,
              speculative=SpecConfig(method=spec.method, k=3, draft=spec.draft, adaptive_k=True, cost_probe=False))
    graphs = use_graphs(llm, capture=False)
    outs = llm.generate(prompts, greedy_params(40))
    assert [o.token_ids for o in outs] == want
    passes = {key[3] for key in graphs.replayed}
    steps = llm.engine.stats()["spec"]["dynamic_k_steps"]
    assert graphs.num_runs > 10
    if method == "ngram":  # drafts from the host: no draft passes in the step, one graph
        assert passes == {key[3] for key in graphs.captured} == {3}, passes
    else:  # random heads are rarely accepted: k falls below 3, and those steps replay their own graphs
        assert {key[3] for key in graphs.captured if key[2] is False} == {0, 1, 2, 3}  # greedy: up front
        assert len(passes) > 1 and passes <= {k for k, n in enumerate(steps) if n} | {3}, (passes, steps)
    assert llm.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.gpu
def test_captured_adaptive_k_replays_equal_eager(llama_dir, spec_drafts):
    """On a GPU: the graphs of each draft-pass count, captured up front, give the eager steps' tokens."""
    prompts = random_prompts(6, seed=12)
    spec = spec_config("mtp", 3, spec_drafts, llama_dir)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=512, block_size=4, max_num_seqs=8,
              speculative=SpecConfig(method="mtp", k=3, draft=spec.draft, adaptive_k=True))
    want = [o.token_ids for o in LLM(llama_dir, device="cuda", dtype="float32", num_kv_blocks=512,
                                     block_size=4).generate(prompts, greedy_params(48))]
    llm = LLM(llama_dir, **kw)
    outs = llm.generate(prompts, greedy_params(48))
    graphs = llm.engine.runner.graphs
    assert [o.token_ids for o in outs] == want
    assert all(graphs.captured.values()), graphs.captured  # every one a CUDA graph
    assert len({key[3] for key in graphs.replayed}) > 1, graphs.replayed


def test_a_perfect_draft_keeps_k_and_a_useless_one_drops_it(llama_dir, spec_drafts):
    """The target drafting for itself is always accepted: k stays at the top (but for the exploring steps);
    random heads are (almost) never accepted: k falls to 0, whose steps run no draft chain."""
    prompts = random_prompts(4, seed=2)
    perfect = LLM(llama_dir, num_kv_blocks=512, block_size=4,
                  speculative=SpecConfig(method="draft_model", k=3, draft=llama_dir, adaptive_k=True, cost_probe=False))
    # The draft cost at its prior, not fitted to this machine's step times: on a loaded CI machine the fit made
    # a draft position look dear enough to keep k at 2 ([0, 0, 12, 1]); this test is about the acceptance side (a
    # draft model as large as the target really is dear: the probe prices it so).
    perfect.engine.drafter.adaptive.measured = False
    perfect.generate(prompts, greedy_params(80))
    steps = perfect.engine.stats()["spec"]["dynamic_k_steps"]
    assert steps[3] >= 0.8 * sum(steps), steps  # from the prior's k=2 to k=3 within a few steps
    useless = LLM(llama_dir, num_kv_blocks=512, block_size=4,
                  speculative=SpecConfig(method="mtp", k=3, draft=spec_drafts["mtp"], adaptive_k=True,
                                         cost_probe=False))
    useless.engine.drafter.adaptive.measured = False
    outs = useless.generate(prompts, greedy_params(40))
    steps = useless.engine.stats()["spec"]["dynamic_k_steps"]
    assert steps[0] >= 0.6 * sum(steps), steps
    assert all(o.speculative.draft_tokens < o.speculative.verify_steps for o in outs)


def test_choose_explores_up_for_two_steps_and_down_for_one_in_turn():
    """Every EXPLORE_EVERY steps a neighbouring k runs: up for two steps (the second verifies the first's deeper
    chain), the next time down for one (it learns k - 1's cost, k = 0's too, and no depth k does not see); at the top
    only the down rounds explore. A neighbour far below (k = 0 here, 20% slower by the estimates) only in one round
    of EXPLORE_FAR: the second's, not the first's."""
    ks = {k_top: [] for k_top in (1, 3)}
    for k_top in ks:
        ctl = _measured(A.AdaptiveK(3, measured=True), 1)
        vote = A.Vote((500, 700, 800), _line(200, 3), 1)  # decide() -> 1 under k_max 3 (and under 1)
        ks[k_top] = [ctl.choose(vote, k_top) for _ in range(4 * A.EXPLORE_EVERY + 2)]
    up = {A.EXPLORE_EVERY - 1, A.EXPLORE_EVERY, 3 * A.EXPLORE_EVERY - 1, 3 * A.EXPLORE_EVERY}  # 0-based
    down = {2 * A.EXPLORE_EVERY - 1}  # round 4 is EXPLORE_FAR's skip of the far k = 0
    assert [i for i, k in enumerate(ks[3]) if k != 1] == sorted(up | down)
    assert {ks[3][i] for i in up} == {2} and {ks[3][i] for i in down} == {0}
    assert [i for i, k in enumerate(ks[1]) if k != 1] == sorted(down) and ks[1][min(down)] == 0


def test_choose_explores_a_far_neighbour_in_one_round_of_explore_far():
    """k = 3 far ahead of k = 2 (guided JSON at batch 1): the rounds that would step down (every other one at the
    top) run k = 3 but in one of EXPLORE_FAR pairs of rounds; a near neighbour is explored every down round."""
    far = A.Vote((950, 1900, 2850), (1050, 1100, 1150), 1)  # k=3: 3.35 tokens per cost, k=2: 2.64
    near = A.Vote((600, 1100, 1250), (1050, 1100, 1150), 1)  # k=3 decided, k=2 2.5% below
    rounds = 4 * A.EXPLORE_FAR
    for vote, want in ((far, [r for r in range(2, rounds, 2) if (r // 2) % A.EXPLORE_FAR == 1]),
                       (near, list(range(2, rounds, 2)))):
        ctl = _measured(A.AdaptiveK(3, measured=True), 1)
        decided = A.decide(1, vote.gain, vote.cost, 3)
        ks = [ctl.choose(vote, 3) for _ in range(rounds * A.EXPLORE_EVERY - 1)]  # rounds 1 .. rounds - 1
        explored = sorted({(i + 1) // A.EXPLORE_EVERY for i, k in enumerate(ks) if k != decided})
        assert explored == want, (decided, explored)
        assert all(ks[r * A.EXPLORE_EVERY - 1] == 2 and ks[r * A.EXPLORE_EVERY] == 3 for r in explored)  # one step


def _measured(ctl: A.AdaptiveK, batch: int) -> A.AdaptiveK:
    """ctl as if every k had run enough steps at `batch` for its cost there to be its own (not unmeasured)."""
    for _ in range(A.UNMEASURED):
        for k in range(ctl.k + 1):
            ctl._ran.setdefault(A.StepCost.bucket(batch), [0] * (ctl.k + 1))[k] += 1
    return ctl


def test_choose_explores_an_unmeasured_k_in_every_round_until_it_has_run():
    """Settled at k = 1 with k = 3 priced by a guess that puts it 10% below and k = 2 below that (guided JSON at
    batch 1 after a start-up probe that over-priced k = 3): the up rounds explore k = 3, not the neighbour, until it has
    run UNMEASURED steps, then k = 2 until it has too; measured, the far neighbour runs in EXPLORE_FAR's rounds only.
    The down rounds explore k = 0 until it has run as many steps. Another batch bucket has run nothing yet."""
    vote = A.Vote((900, 1300, 2000), (1300, 2000, 2270), 1)  # rates 1.46, 1.15, 1.32: decide() -> 1
    assert A.decide(1, vote.gain, vote.cost, 3) == 1 and not A.near(vote, 1, 3) and not A.near(vote, 1, 2)
    ctl = A.AdaptiveK(3, measured=True)
    E = A.EXPLORE_EVERY
    ks = [ctl.choose(vote, 3) for _ in range(16 * E)]
    rounds = {r: [ks[i] for i in (r * E - 1, r * E) if ks[i] != 1] for r in range(1, 16)}
    up = {1: [3, 3], 3: [3, 3], 5: [2, 2], 7: [2, 2], 9: [], 11: [2, 2], 13: [], 15: []}  # 11: EXPLORE_FAR's
    down = {2: [0], 4: [0], 6: [0], 8: [0], 10: [0], 12: [], 14: []}
    assert rounds == {**up, **down}, rounds
    assert all(ks[i] == 1 for i in range(len(ks)) if (i + 1) % E > 1)  # nothing between rounds
    assert ctl.unmeasured(A.Vote(vote.gain, vote.cost, 8), 3) and not ctl.unmeasured(vote, 3)


def test_choose_explores_k1_soon_after_settling_at_zero():
    """k = 0 observes no acceptance, so after EXPLORE_IDLE steps decided at 0 two steps verify one draft; k = 0
    in between."""
    ctl = A.AdaptiveK(3, measured=True)
    off = A.Vote((50, 60, 70), _line(200, 3), 1)  # decide() -> 0: 0.05 expected drafts for a fifth of a step
    ks = [ctl.choose(off, 3) for _ in range(3 * (A.EXPLORE_IDLE + 2))]
    ones = [i for i, k in enumerate(ks) if k]
    assert ones == [i for n in range(1, 4) for i in (n * (A.EXPLORE_IDLE + 2) - 2, n * (A.EXPLORE_IDLE + 2) - 1)], ks
    assert {ks[i] for i in ones} == {1}
    on = A.Vote((500, 700, 800), _line(200, 3), 1)  # decide() -> 1
    fresh = A.AdaptiveK(3, measured=True)
    ks = [fresh.choose(v, 3) for v in [off] * (A.EXPLORE_IDLE - 2) + [on] + [off] * (A.EXPLORE_IDLE + 2)]
    assert ks.count(1) == 3 and ks[-2:] == [1, 1], ks  # the count of idle steps starts again after a step at k > 0


def test_seeded_sampling_equals_no_speculation_with_adaptive_k(llama_dir, near_draft, monkeypatch):
    """Seeded sampling is bit for bit the same whatever k each step takes (coupled verification), and unseeded
    sampling runs (rejection sampling reads the draft distributions a shorter chain wrote only in part).

    The k each step takes comes from a fixed schedule through 0..3 laid over the controller's own decision (which
    still runs, so its state moves as in a real run): what the controller picks depends on this machine's step times
    (a draft model as large as the target costs ~2 plain steps at k = 1, which cannot pay, so on a slow CI machine it
    settled at k = 0 and never moved), and this test is about verification across changing k, not about pricing."""
    import itertools

    from engine import SamplingParams

    schedule = itertools.cycle((3, 0, 2, 1, 1, 3, 0, 0, 2, 3, 3, 1))
    decide = A.AdaptiveK.choose

    def scheduled(self, vote, k_max):
        decide(self, vote, k_max)
        return min(next(schedule), k_max)

    monkeypatch.setattr(A.AdaptiveK, "choose", scheduled)
    params = [SamplingParams(max_tokens=90, temperature=(0.7, 1.0)[i % 2], seed=(70 + i if i % 3 else None),
                             ignore_eos=True) for i in range(6)]
    prompts = random_prompts(6, seed=4)
    want = LLM(llama_dir, num_kv_blocks=512, block_size=4).generate(prompts, params)
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4,
              speculative=SpecConfig(method="draft_model", k=3, draft=near_draft, adaptive_k=True))
    outs = llm.generate(prompts, params)
    assert [o.token_ids for p, o in zip(params, outs) if p.seed is not None] == \
           [o.token_ids for p, o in zip(params, want) if p.seed is not None]
    assert all(len(o.token_ids) == 90 for o in outs)
    steps = llm.engine.stats()["spec"]["dynamic_k_steps"]
    assert all(n > 0 for n in steps), steps  # every k ran, after every other


def test_exploring_a_dear_k_spends_at_most_its_budget():
    """A k = 1 step costing 1.5 plain ones with 7 of 16 drafts accepted: settled at k = 0, the exploring pairs at
    k = 1 space out so that what they cost beyond k = 0 stays within EXPLORE_BUDGET of the time; they still run (with
    half the missed drafts accepted it would beat k = 0). One that could not beat k = 0 even so (3.6 plain steps:
    batch 16 on a 2-core CPU; 1.9 with 0.3 of 16 drafts accepted; 2.0 or more, which loses with every draft accepted)
    never runs."""
    ctl = A.AdaptiveK(3, measured=True)
    dear = A.Vote((7000, 9000, 10000), (1500, 2500, 3200), 16)  # decide() -> 0
    steps = 400
    ks = [ctl.choose(dear, 3) for _ in range(steps)]
    explored = [i for i, k in enumerate(ks) if k]
    assert explored and all(k == 1 for k in (ks[i] for i in explored))
    assert len(explored) * (1500 - A.SCALE) <= A.EXPLORE_BUDGET * steps
    if len(explored) % 2:  # a pair cut by the end of the run
        assert explored.pop() == steps - 1
    assert all(explored[i + 1] == explored[i] + 1 for i in range(0, len(explored), 2))
    for gains, hopeless in (((300, 400, 450), (3600, 4000, 4400)), ((300, 400, 450), (1900, 2500, 3200)),
                            ((16000, 32000, 48000), (2000, 3000, 4000))):
        ctl = A.AdaptiveK(3, measured=True)
        assert not any(ctl.choose(A.Vote(gains, hopeless, 16), 3) for _ in range(steps))
    cheap = A.AdaptiveK(3, measured=True)  # a cheap k = 1 keeps its pair every EXPLORE_IDLE + 2 steps
    ks = [cheap.choose(A.Vote((50, 60, 70), _line(100, 3), 1), 3) for _ in range(5 * (A.EXPLORE_IDLE + 2))]
    assert sum(1 for k in ks if k) >= 10  # (and the round of EXPLORE_EVERY explores up too)
