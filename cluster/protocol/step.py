"""The step link's records: one RankStep out to each rank of a decode group per step, one StepReport back.

Over the step link (cluster/step_link.py) each travels as its `to_wire()` value in a msgpack frame, after
both ends exchanged STEP_LINK_VERSION when the link opened; a step sent as a Ray call (the measuring mode,
GroupSpec.step_link off) travels as the record itself. Wire forms are positional arrays, in the order of
each record's `WIRE` names: the step path runs every step, and names would be most of its bytes.
`from_wire` checks every field (cluster/protocol/wire.py) and raises ProtocolError naming the one that is
wrong.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cluster.protocol import wire
from cluster.protocol.block_filter import read_bits
from cluster.protocol.prefill import PrefillRequest
from engine.outputs import SpecUsage

STEP_LINK_VERSION = 6  # bump on any change to a WIRE below (exchanged when a step link opens; 3: PIN, StepReport.reused;
# 4: StepReport.prefix_view; 5: TokenDelta.speculative; 6: ADMIT)


class CommandKind(enum.Enum):
    RESERVE = "reserve"  # allocate blocks for an arrived header and let the payload in
    COMMIT = "commit"  # the payload landed on every rank: join the running batch
    ABORT = "abort"  # end the request, free its blocks
    DROP = "drop"  # refuse an arrived header (its request is gone): no payload is sent
    PIN = "pin"  # an opened request: hold the leading prompt blocks the rank's prefix cache has, say how many
    ADMIT = "admit"  # an opened request the group prefills itself (no hand-over): join the batch as a new request


_KINDS = {k.value: k for k in CommandKind}


@dataclass(frozen=True, slots=True)
class Command:
    kind: CommandKind
    request_id: str
    prompt_token_ids: tuple[int, ...] = ()  # PIN: the prompt whose cached leading blocks the rank holds
    cache_salt: str | None = None  # PIN: the request's cache salt (blocks are shared within one salt only)
    # ADMIT: the request as a prefill replica would have got it (prompt, sampling parameters, continuation), and
    # the seed it samples with (the replica's choice when the request gave none, so that every rank draws alike
    # and the router can resume it)
    admit: PrefillRequest | None = None
    seed: int | None = None

    WIRE = ("kind", "request_id", "prompt_token_ids", "cache_salt", "admit", "seed")

    def to_wire(self) -> tuple:
        return (self.kind.value, self.request_id, self.prompt_token_ids, self.cache_salt,
                None if self.admit is None else self.admit.to_wire(), self.seed)

    @staticmethod
    def from_wire(raw) -> "Command":
        """PrefillRequest.from_wire checks an ADMIT's request (its version, fields, sampling parameters)."""
        kind, request_id, prompt, salt, admit, seed = wire.record(raw, "Command", Command.WIRE)
        wire.check(kind in _KINDS, "Command", "kind", f"one of {sorted(_KINDS)}", kind)
        wire.check((admit is not None) == (kind == CommandKind.ADMIT.value), "Command", "admit",
                   "a PrefillRequest on an ADMIT only", admit)
        return Command(_KINDS[kind], wire.text(request_id, "Command", "request_id"),
                       wire.ints(prompt, "Command", "prompt_token_ids"),
                       wire.text_or_none(salt, "Command", "cache_salt"),
                       None if admit is None else PrefillRequest.from_wire(admit),
                       None if seed is None else wire.integer(seed, "Command", "seed"))


@dataclass(frozen=True, slots=True)
class RankStep:
    """One rank's share of one group step. Every rank gets one each step, with or without commands: the
    ranks of a group step together, and a rank with nothing of its own still takes part in the step's
    forward when the group runs one (with attention data parallelism, as an idle forward)."""
    commands: tuple[Command, ...]  # applied in order before the forward
    forward: bool  # the group runs a forward this step (some rank holds running requests)
    reports_tokens: bool  # this rank's deltas are the ones delivered to streams (under TP: rank 0 only)
    # The group step's number, from 0 for a new group. A rank runs its steps in this order: the replica keeps
    # the next step queued at the ranks while they run this one (decode_worker/deployment.py), over the step
    # link (in order) or as Ray calls (which may reach the actor's threads out of order).
    seq: int = 0

    WIRE = ("commands", "forward", "reports_tokens", "seq")

    def to_wire(self) -> tuple:
        return (tuple(c.to_wire() for c in self.commands), self.forward, self.reports_tokens, self.seq)

    @staticmethod
    def from_wire(raw) -> "RankStep":
        commands, forward, reports_tokens, seq = wire.record(raw, "RankStep", RankStep.WIRE)
        return RankStep(tuple(Command.from_wire(c) for c in wire.array(commands, "RankStep", "commands")),
                        wire.flag(forward, "RankStep", "forward"),
                        wire.flag(reports_tokens, "RankStep", "reports_tokens"), wire.integer(seq, "RankStep", "seq"))


FINISH_REASONS = (None, "stop", "length", "abort")


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one request from one step (a step's deltas travel as one list)."""
    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    logprobs: tuple = ()  # (token id, logprob, {top id: logprob} | None) per new token, when asked
    # The request's speculation counts, on its last delta only (the router's usage.speculative); None without
    # speculation or on any other delta. Wire form: SpecUsage's fields in order.
    speculative: SpecUsage | None = None

    WIRE = ("request_id", "token_ids", "finished", "finish_reason", "logprobs", "speculative")

    def to_wire(self) -> tuple:
        spec = self.speculative
        return (self.request_id, self.token_ids, self.finished, self.finish_reason, self.logprobs,
                None if spec is None else (spec.method, spec.draft_tokens, spec.accepted_tokens, spec.forced_tokens,
                                           spec.verify_steps))

    @staticmethod
    def from_wire(raw) -> "TokenDelta":
        # A step's deltas are most of what its report carries: the common shape (no logprobs) is checked in
        # one expression; anything else is read field by field, which names what is wrong.
        if (type(raw) is tuple and len(raw) == 6 and type(raw[0]) is str and type(raw[1]) is tuple
                and type(raw[2]) is bool and raw[3] in FINISH_REASONS and raw[4] == () and raw[5] is None
                and all(type(t) is int for t in raw[1])):
            return TokenDelta(*raw)
        return TokenDelta._read(raw)

    @staticmethod
    def _read(raw) -> "TokenDelta":
        rid, token_ids, finished, reason, logprobs, spec = wire.record(raw, "TokenDelta", TokenDelta.WIRE)
        wire.check(reason in FINISH_REASONS, "TokenDelta", "finish_reason", f"one of {FINISH_REASONS}", reason)
        return TokenDelta(wire.text(rid, "TokenDelta", "request_id"), wire.ints(token_ids, "TokenDelta", "token_ids"),
                          wire.flag(finished, "TokenDelta", "finished"), reason,
                          tuple(_logprob(lp) for lp in wire.array(logprobs, "TokenDelta", "logprobs")),
                          None if spec is None else _spec_usage(spec))


def _spec_usage(raw) -> SpecUsage:
    n = "TokenDelta speculative"
    method, drafted, accepted, forced, steps = wire.record(raw, n, ("method", "draft_tokens", "accepted_tokens",
                                                                    "forced_tokens", "verify_steps"))
    drafted, accepted = wire.integer(drafted, n, "draft_tokens"), wire.integer(accepted, n, "accepted_tokens")
    forced, steps = wire.integer(forced, n, "forced_tokens"), wire.integer(steps, n, "verify_steps")
    wire.check(0 <= accepted <= drafted, n, "accepted_tokens", f"in [0, draft_tokens={drafted}]", accepted)
    wire.check(0 <= forced <= drafted, n, "forced_tokens", f"in [0, draft_tokens={drafted}]", forced)
    wire.check(steps >= 1, n, "verify_steps", "at least 1", steps)
    return SpecUsage(wire.text(method, n, "method"), drafted, accepted, forced, steps)


def _logprob(raw) -> tuple[int, float, dict[int, float] | None]:
    token_id, logprob, top = wire.record(raw, "TokenDelta logprob", ("token_id", "logprob", "top"))
    wire.check(top is None or (type(top) is dict and all(type(k) is int and type(v) is float for k, v in top.items())),
               "TokenDelta logprob", "top", "a map of token id to logprob, or nil", top)
    return (wire.integer(token_id, "TokenDelta logprob", "token_id"),
            wire.number(logprob, "TokenDelta logprob", "logprob"), top)


@dataclass(frozen=True, slots=True)
class StepReport:
    """One rank's answer to one lockstep step call."""
    tp_rank: int
    deltas: tuple[TokenDelta, ...]  # empty unless the rank reports tokens (every TP rank computes the same)
    arrived: tuple[str, ...]  # hand-over headers parked since the last report (they wait for a RESERVE)
    landed: tuple[str, ...]  # hand-over payloads written into reserved blocks since the last report
    failed: tuple[tuple[str, str], ...]  # (request id, reason): transfers that broke
    deferred: tuple[str, ...]  # reserves refused for lack of free blocks; retried later
    kv_blocks_used: int
    kv_blocks_total: int
    num_running: int
    step_seconds: float
    handover_seconds: tuple[tuple[str, float, float, int], ...] = field(default=())  # (rid, recv s, unpack s, bytes)
    reserved: tuple[str, ...] = field(default=())  # headers that took blocks from the rank's hand-over stock
    grammar: tuple[tuple[str, int], ...] = field(default=())  # the engine's grammar counters (compiles, ...)
    overlapped_steps: int = 0  # the engine's steps launched before its previous step was read (async scheduling)
    committed_on_landing: int = 0  # stocked hand-overs a one-rank group committed itself (DecodeRank._commit_landed)
    # The engine's prefix-cache counters (query_tokens, hit_tokens, cached_blocks, evicted_blocks); empty when off.
    prefix_cache: tuple[tuple[str, int], ...] = field(default=())
    reused: tuple[tuple[str, int], ...] = field(default=())  # (request id, blocks its hand-over reused) per reserve
    # Under attention data parallelism, what the rank's prefix cache holds when that changed since its last report
    # (else None): (block size, the model its block hashes are namespaced by, BlockFilter bits); the controller
    # places a request on the rank holding its prefix (decode_worker/controller.py).
    prefix_view: tuple[int, str, bytes] | None = None

    WIRE = ("tp_rank", "deltas", "arrived", "landed", "failed", "deferred", "kv_blocks_used", "kv_blocks_total",
            "num_running", "step_seconds", "handover_seconds", "reserved", "grammar", "overlapped_steps",
            "committed_on_landing", "prefix_cache", "reused", "prefix_view")

    def to_wire(self) -> tuple:
        return (self.tp_rank, tuple(d.to_wire() for d in self.deltas), self.arrived, self.landed, self.failed,
                self.deferred, self.kv_blocks_used, self.kv_blocks_total, self.num_running, self.step_seconds,
                self.handover_seconds, self.reserved, self.grammar, self.overlapped_steps, self.committed_on_landing,
                self.prefix_cache, self.reused, self.prefix_view)

    @staticmethod
    def from_wire(raw) -> "StepReport":
        (tp_rank, deltas, arrived, landed, failed, deferred, used, total, running, step_s, handover_s, reserved,
         grammar, overlapped, committed, prefix_cache, reused, view) = wire.record(raw, "StepReport", StepReport.WIRE)
        n = "StepReport"
        return StepReport(
            tp_rank=wire.integer(tp_rank, n, "tp_rank"),
            deltas=tuple(TokenDelta.from_wire(d) for d in wire.array(deltas, n, "deltas")),
            arrived=wire.texts(arrived, n, "arrived"), landed=wire.texts(landed, n, "landed"),
            failed=tuple(_pair(f, "failed", wire.text) for f in wire.array(failed, n, "failed")),
            deferred=wire.texts(deferred, n, "deferred"),
            kv_blocks_used=wire.integer(used, n, "kv_blocks_used"),
            kv_blocks_total=wire.integer(total, n, "kv_blocks_total"),
            num_running=wire.integer(running, n, "num_running"), step_seconds=wire.number(step_s, n, "step_seconds"),
            handover_seconds=tuple(_timing(t) for t in wire.array(handover_s, n, "handover_seconds")),
            reserved=wire.texts(reserved, n, "reserved"),
            grammar=tuple(_pair(g, "grammar", wire.integer) for g in wire.array(grammar, n, "grammar")),
            overlapped_steps=wire.integer(overlapped, n, "overlapped_steps"),
            committed_on_landing=wire.integer(committed, n, "committed_on_landing"),
            prefix_cache=tuple(_pair(c, "prefix_cache", wire.integer)
                               for c in wire.array(prefix_cache, n, "prefix_cache")),
            reused=tuple(_pair(p, "reused", wire.integer) for p in wire.array(reused, n, "reused")),
            prefix_view=None if view is None else _prefix_view(view))


def _pair(raw, field_name: str, second) -> tuple:
    """A (str, x) entry of a StepReport list field: `second` reads x."""
    name = f"StepReport {field_name}"
    key, value = wire.record(raw, name, ("name", "value"))
    return (wire.text(key, name, "name"), second(value, name, "value"))


def _timing(raw) -> tuple[str, float, float, int]:
    name = "StepReport handover_seconds"
    rid, recv_s, unpack_s, nbytes = wire.record(raw, name, ("request_id", "recv_s", "unpack_s", "bytes"))
    return (wire.text(rid, name, "request_id"), wire.number(recv_s, name, "recv_s"),
            wire.number(unpack_s, name, "unpack_s"), wire.integer(nbytes, name, "bytes"))


def _prefix_view(raw) -> tuple[int, str, bytes]:
    block_size, model, bits = wire.record(raw, "StepReport.prefix_view", ("block_size", "model", "bits"))
    n = "StepReport.prefix_view"
    return wire.integer(block_size, n, "block_size"), wire.text(model, n, "model"), read_bits(bits, n, "bits")
