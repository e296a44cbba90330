"""cluster.protocol.step: the step link's records go out and come back equal through msgpack, and every way
one can be wrong (length, field type, unknown kind) is a ProtocolError naming the record and field."""
from __future__ import annotations

import pytest

from cluster.errors import ProtocolError
from cluster.protocol import Command, CommandKind, PrefillRequest, RankStep, StepReport, TokenDelta
from cluster.protocol import wire
from engine.core.request import Continuation
from engine.errors import InvalidRequestError
from engine.outputs import SpecUsage
from engine.sampling_params import SamplingParams


def through_msgpack(value):
    return wire.unpack(wire.pack(value), "test record")


def full_report() -> StepReport:
    return StepReport(
        tp_rank=1,
        deltas=(TokenDelta("a", (5, 6, 7), False, None),
                TokenDelta("b", (9,), True, "length", ((9, -0.5, {9: -0.5, 3: -1.25}),)),
                TokenDelta("c", (), True, "abort", ((4, -2.0, None),)),
                TokenDelta("s", (1, 2), True, "stop", speculative=SpecUsage("mtp", 12, 7, 3, 5))),
        arrived=("d", "e"), landed=("f",), failed=(("g", "peer went away"),), deferred=("h",),
        kv_blocks_used=17, kv_blocks_total=256, num_running=3, step_seconds=0.0125,
        handover_seconds=(("f", 0.002, 0.0005, 4096),), reserved=("d",), grammar=(("compiles", 2), ("hits", 5)),
        overlapped_steps=11, committed_on_landing=1,
        prefix_cache=(("query_tokens", 96), ("hit_tokens", 64), ("cached_blocks", 5), ("evicted_blocks", 0)),
        reused=(("d", 3), ("e", 0)), prefix_view=(16, "smollm2", bytes(range(256)) * 4))


@pytest.mark.parametrize("kind", [k for k in CommandKind if k is not CommandKind.ADMIT])
def test_command_round_trip(kind):
    assert Command.from_wire(through_msgpack(Command(kind, "r1").to_wire())) == Command(kind, "r1")


def test_admit_command_carries_the_request_and_its_seed():
    request = PrefillRequest("r1", (5, 6, 7), SamplingParams(temperature=0.7, max_tokens=9, stop=["x"]),
                             Continuation((8, 9), 123, ()))
    admit = Command(CommandKind.ADMIT, "r1", admit=request, seed=123)
    assert Command.from_wire(through_msgpack(admit.to_wire())) == admit
    with pytest.raises(ProtocolError, match="admit"):  # an ADMIT without its request, or another kind with one
        Command.from_wire(Command(CommandKind.ADMIT, "r1").to_wire())
    with pytest.raises(ProtocolError, match="admit"):
        Command.from_wire((*Command(CommandKind.PIN, "r1").to_wire()[:4], request.to_wire(), None))
    with pytest.raises(InvalidRequestError, match="temperature"):  # parameters are checked as a prefill would
        bad = list(request.to_wire())
        bad[3] = {**bad[3], "temperature": -1.0}
        Command.from_wire((*admit.to_wire()[:4], tuple(bad), 123))


def test_pin_command_carries_the_prompt():
    pin = Command(CommandKind.PIN, "r1", (5, 6, 7, 8, 9), "tenant-a")
    assert Command.from_wire(through_msgpack(pin.to_wire())) == pin
    with pytest.raises(ProtocolError, match="prompt_token_ids"):
        Command.from_wire(through_msgpack(("pin", "r1", ["x"], None)))


@pytest.mark.parametrize("commands", [(), (Command(CommandKind.COMMIT, "x"), Command(CommandKind.DROP, "y"))])
def test_rank_step_round_trip(commands):
    work = RankStep(commands, forward=True, reports_tokens=False, seq=12345)
    assert RankStep.from_wire(through_msgpack(work.to_wire())) == work


def test_step_report_round_trip():
    full = full_report()
    assert StepReport.from_wire(through_msgpack(full.to_wire())) == full
    empty = StepReport(0, (), (), (), (), (), 0, 8, 0, 0.0)
    assert StepReport.from_wire(through_msgpack(empty.to_wire())) == empty


def test_a_report_of_lists_comes_back_as_the_same_record():
    """The rank builds some fields as lists; on the wire a list and a tuple are one array."""
    built = StepReport(0, (), ["a"], ["b"], [("c", "why")], [], 1, 2, 3, 0.5)
    back = StepReport.from_wire(through_msgpack(built.to_wire()))
    assert back.arrived == ("a",) and back.failed == (("c", "why"),)


def _with(record_wire: tuple, names: tuple[str, ...], field: str, value) -> tuple:
    changed = list(record_wire)
    changed[names.index(field)] = value
    return tuple(changed)


@pytest.mark.parametrize("field, value, message", [
    ("tp_rank", 1.0, "StepReport field 'tp_rank' must be an int"),
    ("kv_blocks_used", True, "StepReport field 'kv_blocks_used' must be an int"),
    ("step_seconds", "0.1", "StepReport field 'step_seconds' must be a number"),
    ("arrived", ("a", 3), "StepReport field 'arrived' must be an array of strs"),
    ("arrived", "a", "StepReport field 'arrived' must be an array"),
    ("failed", (("g",),), "StepReport failed must have 2 fields"),
    ("grammar", (("compiles", "2"),), "StepReport grammar field 'value' must be an int"),
    ("prefix_cache", (("hit_tokens", 1.0),), "StepReport prefix_cache field 'value' must be an int"),
    ("handover_seconds", (("f", 0.1, 0.1, 1.5),), "StepReport handover_seconds field 'bytes' must be an int"),
    ("prefix_view", (16, "m"), "StepReport.prefix_view must have 3 fields"),
    ("prefix_view", (16, "m", b"\x01" * 3), "StepReport.prefix_view field 'bits' must be a power of two"),
    ("deltas", (("a", (1, "2"), False, None, (), None),), "TokenDelta field 'token_ids' must be an array of ints"),
    ("deltas", (("a", (1,), False, "eos", (), None),), "TokenDelta field 'finish_reason' must be one of"),
    ("deltas", (("a", (1,), 0, None, (), None),), "TokenDelta field 'finished' must be a bool"),
    ("deltas", (("a", (1,), False, None, ()),), "TokenDelta must have 6 fields"),
    ("deltas", (("a", (1,), False, None, ((1, -0.5, {"1": -0.5}),), None),), "TokenDelta logprob field 'top'"),
    ("deltas", (("a", (1,), True, "stop", (), ("mtp", 3, 4, 0, 2)),), "field 'accepted_tokens' must be in"),
    ("deltas", (("a", (1,), True, "stop", (), ("mtp", 3, 1, 4, 2)),), "field 'forced_tokens' must be in"),
    ("deltas", (("a", (1,), True, "stop", (), ("mtp", 0, 0, 0, 0)),), "field 'verify_steps' must be at least 1"),
    ("deltas", (("a", (1,), True, "stop", (), ("mtp", 3, 1, 0)),), "TokenDelta speculative must have 5 fields"),
    ("deltas", (("a", (1,), True, "stop", (), (3, 3, 1, 0, 1)),), "speculative field 'method' must be a str"),
])
def test_a_malformed_report_names_its_field(field, value, message):
    raw = _with(through_msgpack(full_report().to_wire()), StepReport.WIRE, field, value)
    with pytest.raises(ProtocolError, match=message):
        StepReport.from_wire(raw)


@pytest.mark.parametrize("raw, message", [
    ((((("reserve", "r"),), True, True)), "RankStep must have 4 fields"),
    (((("reserve", "r"),), True, True, 0, 0.0), "RankStep must have 4 fields"),
    ({"commands": ()}, "RankStep must be an array"),
    (((("evict", "r", (), None, None, None),), True, True, 0), "Command field 'kind' must be one of"),
    (((("reserve", 7, (), None, None, None),), True, True, 0), "Command field 'request_id' must be a str"),
    (((("reserve", "r", (), None),), True, True, 0), "Command must have 6 fields"),
    (((("pin", "r", (1,), 3, None, None),), True, True, 0), "Command field 'cache_salt'"),
    (((), "yes", True, 0), "RankStep field 'forward' must be a bool"),
    (((), True, True, None), "RankStep field 'seq' must be an int"),
])
def test_a_malformed_step_names_its_field(raw, message):
    with pytest.raises(ProtocolError, match=message):
        RankStep.from_wire(raw)


def test_a_report_one_field_longer_is_refused():
    """A field sent and never read is a protocol bug (the two sides disagree on the record), not a spare."""
    with pytest.raises(ProtocolError, match="StepReport must have 18 fields"):
        StepReport.from_wire(full_report().to_wire() + (0,))


def test_bytes_that_are_not_msgpack_are_a_protocol_error():
    with pytest.raises(ProtocolError, match="a step frame is not valid msgpack"):
        wire.unpack(wire.pack(full_report().to_wire())[:-3], "a step frame")
