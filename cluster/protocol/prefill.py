"""What the router asks of a prefill replica (PrefillRequest, with the DecodeTarget it chose) and what
the replica answers: the first token (PrefillResult) and, once, what the router needs to validate and
tokenize requests (ModelInfo).

The request crosses the Serve call as its wire form, which carries PREFILL_VERSION first: a router and a
prefill replica of different Tandem versions meet as a ProtocolVersionError at the call, not as a
TypeError deep in the engine. Its sampling parameters are built (and so validated) on the router's side;
the wire carries their fields, and the prefill side builds them again, refusing a field it does not know.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cluster.protocol import wire
from engine.core.request import Continuation
from engine.handover import sampling_params_dict
from engine.sampling_params import SamplingParams

# Bump on any change to PrefillRequest's wire form or to SamplingParams' fields (2: the continuation: output
# tokens, their logprobs and the seed of a request resumed after a worker died under it).
PREFILL_VERSION = 2
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


RESUMED_MARK = "~r"  # a resumed request reaches the workers as `<id>~r<n>`: attempt n after a worker died


def attempt_id(request_id: str, attempt: int) -> str:
    """The id of a request's `attempt` (0: the first) at the workers: resumptions get their own, so a late
    message of a dead attempt (a cancel, a stale delta) never meets the new one."""
    return request_id if attempt == 0 else f"{request_id}{RESUMED_MARK}{attempt}"


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # validated by the router when it built them
    # A resumed request (router/generation.py): the output it had streamed before a worker died under it; the
    # prefill runs prompt + these tokens and samples what follows them, with the same seed.
    continuation: Continuation | None = None

    WIRE = ("request_id", "prompt_token_ids", "params", "continuation")

    def to_wire(self) -> tuple:
        c = self.continuation
        cont = None if c is None else (tuple(c.output_token_ids), c.seed,
                                       tuple((t, lp, top) for t, lp, top in c.logprobs))
        return (PREFILL_VERSION, self.request_id, tuple(self.prompt_token_ids), sampling_params_dict(self.params), cont)

    @staticmethod
    def from_wire(raw) -> "PrefillRequest":
        """ProtocolVersionError for another version's request, ProtocolError naming a malformed field, and
        InvalidRequestError (naming its parameter) for sampling parameters SamplingParams refuses."""
        rid, prompt, params, cont = wire.versioned(raw, "PrefillRequest", PREFILL_VERSION, PrefillRequest.WIRE)
        prompt = wire.ints(prompt, "PrefillRequest", "prompt_token_ids")
        wire.check(bool(prompt), "PrefillRequest", "prompt_token_ids", "a non-empty array of ints", prompt)
        wire.check(type(params) is dict and all(type(k) is str for k in params), "PrefillRequest", "params",
                   "a map of SamplingParams fields", params)
        unknown = params.keys() - _PARAM_FIELDS
        wire.check(not unknown, "PrefillRequest", "params", f"SamplingParams fields only (unknown: {sorted(unknown)})",
                   params)
        return PrefillRequest(wire.text(rid, "PrefillRequest", "request_id"), prompt, SamplingParams(**params),
                              None if cont is None else _continuation(cont))


def _continuation(raw) -> Continuation:
    out, seed, logprobs = wire.record(raw, "PrefillRequest continuation", ("output_token_ids", "seed", "logprobs"))
    out = wire.ints(out, "PrefillRequest continuation", "output_token_ids")
    wire.check(bool(out), "PrefillRequest continuation", "output_token_ids", "a non-empty array of ints", out)
    seed = wire.integer(seed, "PrefillRequest continuation", "seed")
    entries = wire.array(logprobs, "PrefillRequest continuation", "logprobs")
    for e in entries:
        wire.check(type(e) in (tuple, list) and len(e) == 3 and type(e[0]) is int and isinstance(e[1], float)
                   and (e[2] is None or type(e[2]) is dict), "PrefillRequest continuation", "logprobs",
                   "(token id, logprob, top | None) per output token", e)
    return Continuation(out, seed, tuple((t, lp, top) for t, lp, top in entries))


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    token_ids: list[int]  # output tokens sampled by the prefill (the first one)
    finished: bool  # True: nothing to hand over (stopped at the first token, or aborted)
    finish_reason: str | None
    logprobs: list = field(default_factory=list)  # (token id, logprob, top) per token, when asked
    queue_seconds: float = 0.0  # submitted -> first scheduled
    prefill_seconds: float = 0.0  # first scheduled -> first token
    # SamplingParams.prompt_logprobs: (token id, logprob, top) per prompt token, None for the first; [] if not asked
    prompt_logprobs: list = field(default_factory=list)
    seed: int | None = None  # the seed it samples with (drawn here when the request gave none): a resumption's


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the router needs to validate and tokenize requests."""
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
