"""The wire protocol the deployments share; prefill, decode and router meet only here.

- `decode`: a decode group's address (DecodeTarget, its ranks and KV layout; DecodeOpened names the replica
  too).
- `step`: the step link's records: the per-rank commands a group applies in lockstep (RankStep) and what a
  step reports (StepReport, TokenDelta), with STEP_LINK_VERSION.
- `feed`: the feed link's records: one step's items for a router (FeedBatch) and how a request's stream
  ends with an error (StreamError), with FEED_LINK_VERSION.
- `prefill`: what the router asks of a prefill replica (PrefillRequest, with PREFILL_VERSION on its wire
  form) and what it answers.
- `handover`: the versioned msgpack header of one KV hand-over (HandoverHeader) and its named payload.
- `load`: the routing stats each worker replica reports for the routers' policy (PrefillLoad, DecodeLoad).
- `wire`: the strict field checks every `from_wire` uses.

Everything here is small and frozen. What crosses a link or a channel (the step and feed links' records,
the hand-over header) has `to_wire`/`from_wire` and travels as msgpack, never as a pickle; a malformed
record is a ProtocolError naming its field, another version a ProtocolVersionError. What crosses a Ray call
as a wire form (the prefill request, routing stats) carries its version in it.
"""
from cluster.protocol.decode import DecodeOpened, DecodeTarget, KVLayout, RankEndpoint
from cluster.protocol.feed import FEED_LINK_VERSION, FeedBatch, StreamError
from cluster.protocol.handover import (HANDOVER_VERSION, DraftsHandover, GrammarHandover, HandoverHeader,
                                       HandoverPayload, PayloadPart)
from cluster.protocol.prefill import (PREFILL_VERSION, RESUMED_MARK, ModelInfo, PrefillRequest, PrefillResult,
                                     attempt_id)
from cluster.protocol.step import STEP_LINK_VERSION, Command, CommandKind, RankStep, StepReport, TokenDelta

__all__ = ["Command", "CommandKind", "DecodeOpened", "DecodeTarget", "KVLayout", "RankEndpoint", "RankStep",
           "StepReport", "StreamError", "TokenDelta", "STEP_LINK_VERSION", "FEED_LINK_VERSION", "FeedBatch",
           "HANDOVER_VERSION", "DraftsHandover", "GrammarHandover", "HandoverHeader", "HandoverPayload", "PayloadPart",
           "PREFILL_VERSION", "RESUMED_MARK", "ModelInfo", "PrefillRequest", "PrefillResult",
           "attempt_id"]
