"""What one engine hands another when a prefilled request moves on to decode (disaggregated serving).

`HandoverRequest` is the request as the receiving engine must rebuild it: its tokens, how far its KV is
computed, its sampling parameters and seed (sampling depends only on (seed, position), so the decode
side continues the same random stream), the logprobs already produced, and the cache layout its KV
blocks are in. It is plain data: `to_dict`/`from_dict` give msgpack-able values, and `from_dict`
rejects a malformed description with a typed error instead of building a broken request. The wire
format around it (version, payload parts, grammar state) belongs to `cluster.protocol`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from structured.request import SerializedGrammar

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, slots=True)
class HandoverRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]  # tokens sampled on the prefill side (the first one, usually)
    num_computed_tokens: int  # tokens whose KV the hand-over carries
    seed: int
    params: SamplingParams
    logprobs: tuple[tuple[int, float, dict[int, float] | None], ...]  # (token, logprob, top) per output token
    block_size: int
    cache_layers: int  # KV layers per block: the target's, then the draft's (speculation)
    speculative_method: str | None = None  # the prefill side's draft method; None without speculation

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt_token_ids": list(self.prompt_token_ids),
            "output_token_ids": list(self.output_token_ids),
            "num_computed_tokens": self.num_computed_tokens,
            "seed": self.seed,
            "params": sampling_params_dict(self.params),
            "logprobs": [[t, lp, top] for t, lp, top in self.logprobs],
            "block_size": self.block_size,
            "cache_layers": self.cache_layers,
            "speculative_method": self.speculative_method,
        }

    @staticmethod
    def from_dict(d: dict) -> "HandoverRequest":
        """Raises InvalidRequestError naming the field when `d` is not a request description."""
        try:
            params = SamplingParams(**d["params"])
            req = HandoverRequest(
                request_id=_typed(d, "request_id", str),
                prompt_token_ids=tuple(_ints(d, "prompt_token_ids")),
                output_token_ids=tuple(_ints(d, "output_token_ids")),
                num_computed_tokens=_typed(d, "num_computed_tokens", int),
                seed=_typed(d, "seed", int),
                params=params,
                logprobs=tuple((int(t), float(lp), {int(i): float(v) for i, v in top.items()} if top else None)
                               for t, lp, top in d.get("logprobs", ())),
                block_size=_typed(d, "block_size", int),
                cache_layers=_typed(d, "cache_layers", int),
                speculative_method=d.get("speculative_method"),
            )
        except KeyError as e:
            raise InvalidRequestError(f"hand-over request description lacks field {e.args[0]!r}",
                                      param="handover") from None
        except (TypeError, ValueError, AttributeError) as e:
            if isinstance(e, InvalidRequestError):
                raise
            raise InvalidRequestError(f"malformed hand-over request description: {e}", param="handover") from None
        if not req.prompt_token_ids or not 0 < req.num_computed_tokens <= len(req.prompt_token_ids) + len(
                req.output_token_ids):
            raise InvalidRequestError(f"hand-over of {req.request_id!r} computes {req.num_computed_tokens} of "
                                      f"{len(req.prompt_token_ids)} prompt tokens", param="handover")
        return req


@dataclass(frozen=True, slots=True)
class Handover:
    """A parked request and where its KV lives, as `LLMEngine.take_handover` gives it."""

    request: HandoverRequest
    block_ids: list[int]  # blocks holding the prompt's KV (target and draft layers), in order
    hidden: torch.Tensor | None = None  # [H_in] the draft head's input at the last prompt row (speculation)
    compiled_grammar: SerializedGrammar | None = None  # a guided request's compiled grammar, serialized


def sampling_params_dict(params: SamplingParams) -> dict:
    """`params` as plain values: SamplingParams(**d) builds them again (a hand-over, a prefill request)."""
    out = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingParams)}
    if params.structured_output is not None:
        out["structured_output"] = params.structured_output.to_dict()
    return out


def _typed(d: dict, key: str, kind: type):
    value = d[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise InvalidRequestError(f"hand-over field {key!r} must be {kind.__name__}, got {type(value).__name__}",
                                  param="handover")
    return value


def _ints(d: dict, key: str) -> list[int]:
    values = d[key]
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise InvalidRequestError(f"hand-over field {key!r} must be a list of token ids", param="handover")
    return list(values)
