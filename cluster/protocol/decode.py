"""What crosses the decode worker's boundaries: the decode target a prefill sends to, the commands each
rank of a group applies in lockstep, what one step reports back, and how a request's stream ends with an
error. Small, frozen, picklable."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from cluster.rendezvous import StoreAddress


@dataclass(frozen=True, slots=True)
class RankEndpoint:
    """Where a prefill sends one rank's share of a hand-over."""
    actor: object  # ray.actor.ActorHandle of the DecodeRank
    store: StoreAddress  # the rank's TCPStore: channels to it rendezvous there
    tp_rank: int
    kv_heads: tuple[int, int]  # (first KV head, count) of the full model's KV heads this rank holds


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The decode group's KV cache format; a hand-over must match it."""
    num_layers: int  # cache layers: the target's, then the draft's (speculation)
    num_kv_heads: int  # of the full model (each rank holds its slice)
    head_dim: int
    block_size: int
    dtype: str  # torch dtype name without "torch.", e.g. "float32"


@dataclass(frozen=True, slots=True)
class DecodeTarget:
    """A decode group's address for one request: every rank gets its KV-head slice."""
    group_id: str  # changes whenever the group is rebuilt, so stale channels are never reused
    ranks: tuple[RankEndpoint, ...]
    layout: KVLayout
    device: str  # "cpu" or "cuda": the channel backend follows it


@dataclass(frozen=True, slots=True)
class DecodeOpened:
    """A decode replica's answer to opening a request: where its hand-over goes, and which replica holds it
    (its deltas come on that replica's feed; a cancel must reach that replica)."""
    replica: str  # the Serve replica id
    target: DecodeTarget


class CommandKind(enum.Enum):
    RESERVE = "reserve"  # allocate blocks for an arrived header and let the payload in
    COMMIT = "commit"  # the payload landed on every rank: join the running batch
    ABORT = "abort"  # end the request, free its blocks
    DROP = "drop"  # refuse an arrived header (its request is gone): no payload is sent


@dataclass(frozen=True, slots=True)
class Command:
    kind: CommandKind
    request_id: str


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


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New tokens of one request from one step (a step's deltas travel as one list)."""
    request_id: str
    token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    logprobs: tuple = ()  # (token id, logprob, {top id: logprob} | None) per new token, when asked


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


@dataclass(frozen=True, slots=True)
class StreamError:
    """Ends a request's stream with an error (a typed value: the router maps it to a response)."""
    message: str
    error_type: str = "unavailable_error"
    status: int = 503
