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
from engine.handover import sampling_params_dict
from engine.sampling_params import SamplingParams

PREFILL_VERSION = 1  # bump on any change to PrefillRequest's wire form or to SamplingParams' fields
_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams  # validated by the router when it built them

    WIRE = ("request_id", "prompt_token_ids", "params")

    def to_wire(self) -> tuple:
        return (PREFILL_VERSION, self.request_id, tuple(self.prompt_token_ids), sampling_params_dict(self.params))

    @staticmethod
    def from_wire(raw) -> "PrefillRequest":
        """ProtocolVersionError for another version's request, ProtocolError naming a malformed field, and
        InvalidRequestError (naming its parameter) for sampling parameters SamplingParams refuses."""
        rid, prompt, params = wire.versioned(raw, "PrefillRequest", PREFILL_VERSION, PrefillRequest.WIRE)
        prompt = wire.ints(prompt, "PrefillRequest", "prompt_token_ids")
        wire.check(bool(prompt), "PrefillRequest", "prompt_token_ids", "a non-empty array of ints", prompt)
        wire.check(type(params) is dict and all(type(k) is str for k in params), "PrefillRequest", "params",
                   "a map of SamplingParams fields", params)
        unknown = params.keys() - _PARAM_FIELDS
        wire.check(not unknown, "PrefillRequest", "params", f"SamplingParams fields only (unknown: {sorted(unknown)})",
                   params)
        return PrefillRequest(wire.text(rid, "PrefillRequest", "request_id"), prompt, SamplingParams(**params))


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


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the router needs to validate and tokenize requests."""
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
