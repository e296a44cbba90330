"""The wire protocol the deployments share; prefill, decode and router meet only here.

- `decode`: a decode group's address (DecodeTarget, its ranks and KV layout; DecodeOpened names the replica
  too), the per-rank commands a group applies in lockstep (RankStep), what a step reports (StepReport,
  TokenDelta) and how a request's stream ends with an error (StreamError).
- `prefill`: what the router asks of a prefill replica and what it answers.
- `handover`: the versioned msgpack header of one KV hand-over (HandoverHeader) and its named payload.

Everything here is small, frozen and picklable (it crosses Ray calls), except the hand-over header,
which crosses a torch.distributed channel as msgpack bytes.
"""
from cluster.protocol.decode import (Command, CommandKind, DecodeOpened, DecodeTarget, KVLayout, RankEndpoint,
                                     RankStep, StepReport, StreamError, TokenDelta)
from cluster.protocol.handover import (HANDOVER_VERSION, GrammarHandover, HandoverHeader, HandoverPayload,
                                       PayloadPart)
from cluster.protocol.prefill import ModelInfo, PrefillRequest, PrefillResult

__all__ = ["Command", "CommandKind", "DecodeOpened", "DecodeTarget", "KVLayout", "RankEndpoint", "RankStep",
           "StepReport", "StreamError", "TokenDelta", "HANDOVER_VERSION", "GrammarHandover", "HandoverHeader", "HandoverPayload",
           "PayloadPart", "ModelInfo", "PrefillRequest", "PrefillResult"]
