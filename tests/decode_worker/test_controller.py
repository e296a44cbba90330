"""DecodeController: hand-over bookkeeping between lockstep steps (no Ray). Exact command sequences."""
from __future__ import annotations

import asyncio

from cluster.protocol import Command, CommandKind, StepReport, StreamError, TokenDelta
from cluster.protocol.block_filter import BlockFilter
from engine.core.prefix_hash import extend_hashes, namespace_hash
from decode_worker.controller import DecodeController, Phase

R, C, A, D = CommandKind.RESERVE, CommandKind.COMMIT, CommandKind.ABORT, CommandKind.DROP


def report(rank, deltas=(), arrived=(), landed=(), failed=(), deferred=(), used=0, running=0, reused=(), view=None):
    return StepReport(tp_rank=rank, deltas=tuple(deltas), arrived=tuple(arrived), landed=tuple(landed),
                      failed=tuple(failed), deferred=tuple(deferred), kv_blocks_used=used, kv_blocks_total=64,
                      num_running=running, step_seconds=0.0, reused=tuple(reused), prefix_view=view)


def cmds(ctrl, now=0.0):
    """The next step's commands, which under tensor parallelism are the same list for every rank."""
    steps = ctrl.next_step(now)
    assert len(steps) == ctrl.tp_size and all(s.commands == steps[0].commands for s in steps), steps
    return [(c.kind, c.request_id) for c in steps[0].commands]


def drain(q: asyncio.Queue) -> list:
    out = []
    while not q.empty():
        out.append(q.get_nowait())
    return out


def test_hand_over_then_tokens_reach_the_stream():
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.on_reports([report(0, arrived=["a"]), report(1)])
    assert cmds(ctrl) == []  # one rank has the header: no reserve yet
    ctrl.on_reports([report(0), report(1, arrived=["a"])])
    assert cmds(ctrl) == [(R, "a")] and ctrl.requests["a"].phase is Phase.RESERVING
    ctrl.on_reports([report(0, landed=["a"]), report(1)])
    assert cmds(ctrl) == []
    ctrl.on_reports([report(0), report(1, landed=["a"])])
    assert cmds(ctrl) == [(C, "a")] and ctrl.requests["a"].phase is Phase.RUNNING
    d1 = TokenDelta("a", (5, 6), False, None)
    d2 = TokenDelta("a", (7,), True, "length")
    ctrl.on_reports([report(0, deltas=[d1], used=3, running=1), report(1, deltas=[TokenDelta("zz", (1,), False, None)])])
    ctrl.on_reports([report(0, deltas=[d2]), report(1)])
    assert drain(q) == [d1, d2] and "a" not in ctrl.requests
    assert not ctrl.has_work


def test_cancel_before_reserve_drops_now_and_drops_late_headers():
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.on_reports([report(0, arrived=["a"]), report(1)])
    ctrl.cancel("a")
    assert cmds(ctrl) == [(D, "a")]
    ctrl.on_reports([report(0), report(1, arrived=["a"])])  # the other rank's header comes later
    assert cmds(ctrl) == [(D, "a")]
    assert drain(q) == []


def test_cancel_while_the_payload_lands_aborts_only_after_every_rank_landed():
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.on_reports([report(0, arrived=["a"]), report(1, arrived=["a"])])
    assert cmds(ctrl) == [(R, "a")]
    ctrl.cancel("a")
    assert cmds(ctrl) == []  # blocks are being written: freeing them now could corrupt their next owner
    ctrl.on_reports([report(0, landed=["a"]), report(1)])
    assert cmds(ctrl) == []
    ctrl.on_reports([report(0), report(1, landed=["a"])])
    assert cmds(ctrl) == [(A, "a")] and "a" not in ctrl.requests


def test_transfer_failure_on_one_rank_errors_at_once_and_aborts_after_the_other_settles():
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.on_reports([report(0, arrived=["a"]), report(1, arrived=["a"])])
    cmds(ctrl)
    ctrl.on_reports([report(0, failed=[("a", "peer gone")]), report(1)])
    (err,) = drain(q)
    assert isinstance(err, StreamError) and "peer gone" in err.message
    assert cmds(ctrl) == []
    ctrl.on_reports([report(0), report(1, landed=["a"])])
    assert cmds(ctrl) == [(A, "a")] and drain(q) == []


def test_failure_before_reserve_drops_everywhere():
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.on_reports([report(0, arrived=["a"]), report(1, failed=[("a", "bad header")])])
    assert cmds(ctrl) == [(D, "a")]
    assert isinstance(drain(q)[0], StreamError)


def test_no_free_blocks_defers_the_reserve_to_the_next_step():
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.on_reports([report(0, arrived=["a"]), report(1, arrived=["a"])])
    assert cmds(ctrl) == [(R, "a")]
    ctrl.on_reports([report(0, deferred=["a"]), report(1, deferred=["a"])])
    assert cmds(ctrl) == [(R, "a")]


def test_header_that_never_comes_times_out():
    ctrl, q = DecodeController(tp_size=2, handover_timeout_s=5.0), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.requests["a"].deadline = 10.0
    assert cmds(ctrl, now=9.0) == []
    assert cmds(ctrl, now=11.0) == [(D, "a")]
    (err,) = drain(q)
    assert isinstance(err, StreamError) and "did not reach" in err.message


def test_group_failure_ends_every_stream():
    ctrl = DecodeController(tp_size=2)
    queues = [asyncio.Queue() for _ in range(3)]
    for i, q in enumerate(queues):
        ctrl.expect(f"r{i}", q)
    ctrl.fail_all("rank died")
    assert all(isinstance(drain(q)[0], StreamError) for q in queues)
    assert not ctrl.has_work


def test_duplicate_request_ids_are_refused():
    ctrl = DecodeController(tp_size=1)
    ctrl.expect("a", asyncio.Queue())
    try:
        ctrl.expect("a", asyncio.Queue())
    except ValueError as e:
        assert "already" in str(e)
    else:
        raise AssertionError("a duplicate id was accepted")


def plan(ctrl, now=0.0):
    """Per rank: (commands, forward, reports_tokens) of the next step."""
    return [([(c.kind, c.request_id) for c in s.commands], s.forward, s.reports_tokens) for s in ctrl.next_step(now)]


def test_every_rank_steps_with_the_group_and_only_rank_0_reports_tokens():
    ctrl, q = DecodeController(tp_size=3), asyncio.Queue()
    assert plan(ctrl) == [([], False, False)] * 3  # nothing to run: no forward, but a step for every rank
    ctrl.expect("a", q)
    ctrl.on_reports([report(r, arrived=["a"]) for r in range(3)])
    assert plan(ctrl) == [([(R, "a")], False, False)] * 3
    ctrl.on_reports([report(r, landed=["a"]) for r in range(3)])
    assert plan(ctrl) == [([(C, "a")], True, True), ([(C, "a")], True, False), ([(C, "a")], True, False)]
    ctrl.on_reports([report(r, deltas=[TokenDelta("a", (4,), True, "stop")]) for r in range(3)])
    assert drain(q) == [TokenDelta("a", (4,), True, "stop")]  # once: the other ranks' copies are not delivered
    assert plan(ctrl) == [([], False, False)] * 3


def test_requests_placed_on_one_rank_each_get_commands_there_while_the_other_rank_still_steps():
    """Per-rank placement (attention data parallelism): each rank gets only its requests' commands, reports
    only its requests' tokens, and an idle rank steps (forward) with the group."""
    ctrl, qa, qb = DecodeController(tp_size=2, attention_dp=True), asyncio.Queue(), asyncio.Queue()
    assert ctrl.expect("a", qa) == (0,)  # equal loads: the lowest rank
    assert ctrl.expect("b", qb) == (1,)  # rank 0 now has a request on its way
    ctrl.on_reports([report(0, arrived=["a"]), report(1)])
    assert plan(ctrl) == [([(R, "a")], False, False), ([], False, False)]  # a's header is complete on rank 0
    ctrl.on_reports([report(0, landed=["a"]), report(1, arrived=["b"])])
    assert plan(ctrl) == [([(C, "a")], True, True), ([(R, "b")], True, False)]  # rank 1 idles through a's forward
    a1, b1 = TokenDelta("a", (5,), False, None), TokenDelta("b", (6,), False, None)
    ctrl.on_reports([report(0, deltas=[a1]), report(1, deltas=[TokenDelta("a", (99,), False, None)], landed=["b"])])
    assert plan(ctrl) == [([], True, True), ([(C, "b")], True, True)]
    ctrl.on_reports([report(0, deltas=[TokenDelta("b", (98,), False, None)]), report(1, deltas=[b1])])
    assert drain(qa) == [a1] and drain(qb) == [b1]
    ctrl.cancel("b")
    assert plan(ctrl) == [([], True, True), ([(A, "b")], True, False)]


def test_adp_places_on_least_kv_then_fewest_requests():
    ctrl = DecodeController(tp_size=3, attention_dp=True)
    ctrl.on_reports([report(0, used=10, running=1), report(1, used=4, running=3), report(2, used=4, running=2)])
    assert ctrl.expect("a", asyncio.Queue(), prompt_blocks=2) == (2,)  # least KV, then fewer running than rank 1
    # rank 2 now expects 2 more blocks (6): rank 1 has the least KV
    assert ctrl.expect("b", asyncio.Queue(), prompt_blocks=2) == (1,)
    assert ctrl.expect("c", asyncio.Queue(), prompt_blocks=1) == (2,)  # 6 vs 6 blocks: rank 2 runs fewer (2+1 < 3+1)
    assert ctrl.placed_total == [0, 1, 2]


BS, MODEL = 4, "m"


def view_of(*prompts, salt=None):
    """A rank's prefix view holding every full block of `prompts` (hashed as its engine would)."""
    hashes = []
    for tokens in prompts:
        hashes += extend_hashes([], list(tokens[: len(tokens) // BS * BS]), BS, namespace_hash(MODEL, salt))
    return (BS, MODEL, BlockFilter.build(hashes, len(hashes)).bits)


def test_adp_places_a_prompt_on_the_rank_holding_its_prefix_within_the_imbalance_guard():
    shared = tuple(range(100, 141))  # 41 tokens: 10 reusable blocks of 4
    ctrl = DecodeController(tp_size=3, attention_dp=True)
    ctrl.on_reports([report(0, used=2), report(1, used=10, view=view_of(shared)), report(2, used=3)])
    # rank 1 holds all 10 blocks: 10 - 2 * 10 < 2, though it is the busiest rank
    assert ctrl.expect("a", asyncio.Queue(), prompt_blocks=11, prompt=(shared, None)) == (1,)
    assert ctrl.placed_for_prefix == 1
    # another salt is another namespace: nothing held, the least loaded rank
    assert ctrl.expect("b", asyncio.Queue(), prompt_blocks=11, prompt=(shared, "s")) == (0,)
    # an unrelated prompt, and a prompt without token ids, go by load
    assert ctrl.expect("c", asyncio.Queue(), prompt_blocks=1, prompt=(tuple(range(41)), None)) == (2,)
    assert ctrl.placed_for_prefix == 1


def test_adp_prefix_placement_never_piles_past_the_imbalance_share():
    shared = tuple(range(100, 141))
    ctrl = DecodeController(tp_size=2, attention_dp=True)
    # rank 1 is 17 blocks (> 0.25 x 64) busier than rank 0: its prefix does not outweigh that
    ctrl.on_reports([report(0, used=0), report(1, used=17, view=view_of(shared))])
    assert ctrl.expect("a", asyncio.Queue(), prompt_blocks=11, prompt=(shared, None)) == (0,)
    # a view stays until a rank sends a new one; a group failure forgets it
    ctrl.on_reports([report(0, used=0), report(1, used=12)])
    assert ctrl.expect("b", asyncio.Queue(), prompt_blocks=11, prompt=(shared, None)) == (1,)
    ctrl.fail_all("gone")
    ctrl.on_reports([report(0, used=0), report(1, used=12)])
    assert ctrl.expect("c", asyncio.Queue(), prompt_blocks=11, prompt=(shared, None)) == (0,)


def test_adp_burst_between_reports_spreads_over_ranks():
    """Requests placed before any report must not pile onto the rank that looked emptiest last step."""
    ctrl = DecodeController(tp_size=2, attention_dp=True)
    ctrl.on_reports([report(0, used=1), report(1, used=0)])
    placed = [ctrl.expect(str(i), asyncio.Queue(), prompt_blocks=4)[0] for i in range(6)]
    assert placed == [1, 0, 1, 0, 1, 0]


def test_adp_sums_load_over_ranks_and_landed_blocks_are_not_counted_twice():
    ctrl = DecodeController(tp_size=2, attention_dp=True)
    ctrl.expect("a", asyncio.Queue(), prompt_blocks=5)  # rank 0
    ctrl.on_reports([report(0, arrived=["a"], used=0), report(1, used=3, running=1)])
    assert cmds_of(ctrl, 0) == [(R, "a")]
    # a's 5 blocks are now reserved on rank 0 and reported there: the estimate no longer adds them
    ctrl.on_reports([report(0, used=5), report(1, used=3, running=1)])
    assert (ctrl.kv_blocks_used, ctrl.kv_blocks_total, ctrl.num_running) == (8, 128, 1)
    assert ctrl.expect("b", asyncio.Queue(), prompt_blocks=1) == (1,)


def cmds_of(ctrl, rank: int) -> list:
    return [(c.kind, c.request_id) for c in ctrl.next_step(0.0)[rank].commands]


def reserved_report(rank, reserved=(), landed=(), arrived=()):
    return StepReport(tp_rank=rank, deltas=(), arrived=tuple(arrived), landed=tuple(landed), failed=(), deferred=(),
                      kv_blocks_used=0, kv_blocks_total=64, num_running=0, step_seconds=0.0, reserved=tuple(reserved))


def test_stocked_on_every_rank_needs_no_lockstep_reserve():
    """Every rank took the header's blocks from its hand-over stock: no RESERVE; COMMIT once all landed."""
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.on_reports([reserved_report(0, reserved=["a"], landed=["a"]), reserved_report(1, reserved=["a"])])
    assert cmds(ctrl) == [] and ctrl.requests["a"].phase is Phase.RESERVING
    ctrl.on_reports([reserved_report(0), reserved_report(1, landed=["a"])])
    assert cmds(ctrl) == [(C, "a")] and ctrl.requests["a"].phase is Phase.RUNNING


def test_one_rank_parked_means_every_rank_reserves_in_lockstep():
    """Rank 1's stock was empty: both ranks get RESERVE (rank 0 reserves too, so both pools change alike)."""
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.on_reports([reserved_report(0, reserved=["a"], landed=["a"]), reserved_report(1, arrived=["a"])])
    assert cmds(ctrl) == [(R, "a")]
    ctrl.on_reports([reserved_report(0), reserved_report(1, landed=["a"])])
    assert cmds(ctrl) == [(C, "a")]


def test_stocked_then_cancelled_or_unknown_is_dropped_everywhere():
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q)
    ctrl.on_reports([reserved_report(0, reserved=["a"]), reserved_report(1)])
    ctrl.cancel("a")  # still EXPECTED (rank 1 has nothing): every rank drops it, rank 0 returns its blocks
    assert cmds(ctrl) == [(D, "a")] and "a" not in ctrl.requests
    ctrl.on_reports([reserved_report(0), reserved_report(1, reserved=["a"], landed=["a"])])
    assert cmds(ctrl) == [(D, "a")]  # a late stocked header of a gone request: dropped (blocks back to stock)


def test_a_one_rank_group_that_committed_on_landing_gets_its_first_tokens_delivered():
    """A tp=1 rank commits a stocked hand-over as soon as it lands (DecodeRank._commit_landed): one report then
    carries the header, the landing and the first tokens; the tokens reach the stream, and the COMMIT that
    follows is the rank's no-op."""
    ctrl, q = DecodeController(tp_size=1), asyncio.Queue()
    ctrl.expect("a", q)
    d1 = TokenDelta("a", (5, 6), False, None)
    early = StepReport(tp_rank=0, deltas=(d1,), arrived=(), landed=("a",), failed=(), deferred=(), kv_blocks_used=2,
                       kv_blocks_total=64, num_running=1, step_seconds=0.0, reserved=("a",), committed_on_landing=1)
    ctrl.on_reports([early])
    assert drain(q) == [d1] and ctrl.requests["a"].phase is Phase.RUNNING
    assert cmds(ctrl) == [(C, "a")] and ctrl.handovers_committed_on_landing == 1
    d2 = TokenDelta("a", (7,), True, "length")
    ctrl.on_reports([report(0, deltas=[d2])])
    assert drain(q) == [d2] and not ctrl.has_work


P = CommandKind.PIN


def test_an_opened_prompt_is_pinned_on_its_ranks_and_reuse_counted_once():
    """An opened prompt is PINned on every rank of its placement, before any other command for it; the blocks
    its hand-over reused count once (the lead rank's reserve report), whichever path reserved it."""
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.expect("a", q, prompt=((1, 2, 3, 4, 5, 6, 7, 8, 9), "salt"))
    steps = ctrl.next_step(0.0)
    assert [s.commands for s in steps] == [(Command(P, "a", (1, 2, 3, 4, 5, 6, 7, 8, 9), "salt"),)] * 2
    ctrl.on_reports([report(0, arrived=["a"]), report(1, arrived=["a"])])
    assert cmds(ctrl) == [(R, "a")]
    ctrl.on_reports([report(0, landed=["a"], reused=[("a", 2)]), report(1, landed=["a"], reused=[("a", 2)])])
    assert cmds(ctrl) == [(C, "a")] and ctrl.handover_blocks_reused == 2
    ctrl.cancel("a")
    ctrl.on_reports([report(0, reused=[("a", 2)]), report(1)])  # a request no longer tracked counts nothing
    assert cmds(ctrl) == [(A, "a")] and ctrl.handover_blocks_reused == 2


def test_a_request_cancelled_while_pinning_is_dropped_after_its_pin():
    """The DROP (which unpins on the ranks) follows the PIN in the same rank's command list."""
    ctrl = DecodeController(tp_size=1)
    ctrl.expect("a", asyncio.Queue(), prompt=((1, 2, 3), None))
    ctrl.expect("b", asyncio.Queue())
    ctrl.cancel("a")
    assert cmds(ctrl) == [(P, "a"), (D, "a")]


def test_the_group_view_is_the_union_of_its_ranks_views():
    a, b = tuple(range(100, 141)), tuple(range(500, 541))
    ctrl = DecodeController(tp_size=2, attention_dp=True)
    assert ctrl.group_view() == (0, "", b"")  # nothing reported yet
    ctrl.on_reports([report(0, view=view_of(a)), report(1, view=view_of(b))])
    block_size, model, bits = ctrl.group_view()
    union = BlockFilter(bits)
    for tokens in (a, b):
        hashes = extend_hashes([], list(tokens[:40]), BS, namespace_hash(MODEL))
        assert union.leading_matches(hashes) == 10
    assert (block_size, model) == (BS, MODEL)


ADMIT = CommandKind.ADMIT


def admit_of(rid, tokens, seed=None, max_tokens=8):
    from cluster.protocol import PrefillRequest
    from engine.sampling_params import SamplingParams

    return PrefillRequest(rid, tuple(tokens), SamplingParams(max_tokens=4, seed=seed)), max_tokens


def test_a_prompt_whose_prefix_the_group_holds_is_admitted_there_and_streams_without_a_hand_over():
    """Conditional disaggregation: rank 0's view holds 10 of a 43-token prompt's blocks (40 tokens): 3 tokens
    are left, within the 8 allowed, so every rank gets an ADMIT (no PIN), the request runs at once, and its
    deltas reach the stream without any hand-over event."""
    shared = tuple(range(100, 141))
    prompt = shared + (7, 8)
    ctrl, q = DecodeController(tp_size=2), asyncio.Queue()
    ctrl.on_reports([report(0, view=view_of(shared)), report(1)])
    ctrl.expect("a", q, prompt_blocks=11, prompt=(prompt, None), admit=admit_of("a", prompt, seed=5))
    t = ctrl.requests["a"]
    assert t.local and t.phase is Phase.RUNNING and t.seed == 5
    steps = ctrl.next_step(0.0)
    assert [[(c.kind, c.seed, c.admit.prompt_token_ids) for c in s.commands] for s in steps] == \
        [[(ADMIT, 5, prompt)]] * 2
    assert steps[0].forward and steps[0].reports_tokens and not steps[1].reports_tokens
    d1, d2 = TokenDelta("a", (9,), False, None), TokenDelta("a", (3, 4), True, "length")
    ctrl.on_reports([report(0, deltas=[d1], running=1), report(1)])
    ctrl.on_reports([report(0, deltas=[d2]), report(1)])
    assert drain(q) == [d1, d2] and not ctrl.requests
    assert (ctrl.local_prefills, ctrl.local_prefill_tokens, ctrl.handovers_total) == (1, 3, 0)


def test_a_local_admission_needs_a_held_prefix_and_a_short_remainder():
    """Nothing held (a short prompt alone stays disaggregated), more than the remainder allowed missing, or
    another salt: the request is PINned and handed over as before. A request without a seed gets one drawn
    by the replica, the same on every rank; a continuation keeps its own."""
    from dataclasses import replace

    from engine.core.request import Continuation

    shared = tuple(range(100, 141))
    ctrl = DecodeController(tp_size=1)
    ctrl.on_reports([report(0, view=view_of(shared))])
    short = (1, 2, 3)
    ctrl.expect("short", asyncio.Queue(), prompt=(short, None), admit=admit_of("short", short))
    far = shared + tuple(range(9))  # 9 left > 8
    ctrl.expect("far", asyncio.Queue(), prompt=(far, None), admit=admit_of("far", far))
    near = shared + (1,)
    ctrl.expect("salted", asyncio.Queue(), prompt=(near, "s"), admit=admit_of("salted", near))
    ctrl.expect("unoffered", asyncio.Queue(), prompt=(near, None))
    assert not any(t.local for t in ctrl.requests.values())
    assert cmds(ctrl) == [(P, "short"), (P, "far"), (P, "salted"), (P, "unoffered")]
    ctrl.expect("drawn", asyncio.Queue(), prompt=(near, None), admit=admit_of("drawn", near))
    request, limit = admit_of("cont", near)
    ctrl.expect("cont", asyncio.Queue(), prompt=(near + (4, 5), None),
                admit=(replace(request, continuation=Continuation((4, 5), 77, ())), limit))
    drawn, cont = ctrl.requests["drawn"], ctrl.requests["cont"]
    assert drawn.local and isinstance(drawn.seed, int) and cont.local and cont.seed == 77
    assert cmds(ctrl) == [(ADMIT, "drawn"), (ADMIT, "cont")]
    assert ctrl.local_prefill_tokens == 2 + 4  # past the 10 held blocks (40 tokens): 42 and 44 tokens known


def test_a_refused_admission_ends_the_stream_with_a_400_and_a_failed_one_with_a_503():
    from decode_worker.controller import ADMIT_REFUSED

    shared = tuple(range(100, 141))
    near = shared + (1,)
    ctrl = DecodeController(tp_size=2)
    ctrl.on_reports([report(0, view=view_of(shared)), report(1)])
    qa, qb = asyncio.Queue(), asyncio.Queue()
    ctrl.expect("a", qa, prompt=(near, None), admit=admit_of("a", near))
    ctrl.expect("b", qb, prompt=(near, None), admit=admit_of("b", near))
    cmds(ctrl)
    ctrl.on_reports([report(0, failed=[("a", f"{ADMIT_REFUSED}prompt too long")]),
                     report(1, failed=[("b", "cannot admit: out of memory")])])
    (ea,), (eb,) = drain(qa), drain(qb)
    assert (ea.status, ea.error_type) == (400, "invalid_request_error") and "prompt too long" in ea.message
    assert (eb.status, eb.error_type) == (503, "unavailable_error")
    assert cmds(ctrl) == [(A, "a"), (A, "b")] and not ctrl.requests
