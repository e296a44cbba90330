"""DecodeController: hand-over bookkeeping between lockstep steps (no Ray). Exact command sequences."""
from __future__ import annotations

import asyncio

from decode_worker.controller import DecodeController, Phase, StreamError
from decode_worker.protocol import Command, CommandKind, StepReport, TokenDelta

R, C, A, D = CommandKind.RESERVE, CommandKind.COMMIT, CommandKind.ABORT, CommandKind.DROP


def report(rank, deltas=(), arrived=(), landed=(), failed=(), deferred=(), used=0, running=0):
    return StepReport(tp_rank=rank, deltas=tuple(deltas), arrived=tuple(arrived), landed=tuple(landed),
                      failed=tuple(failed), deferred=tuple(deferred), kv_blocks_used=used, kv_blocks_total=64,
                      num_running=running, step_seconds=0.0)


def cmds(ctrl, now=0.0):
    return [(c.kind, c.request_id) for c in ctrl.next_commands(now)]


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
