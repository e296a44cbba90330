"""What one engine hands another when a prefilled request moves on to decode (disaggregated serving).

`HandoverRequest` is the request as the receiving engine must rebuild it: its tokens, how far its KV is
computed, its sampling parameters and seed (sampling depends only on (seed, position), so the decode
side continues the same random stream), the logprobs already produced, and the cache layout its KV
blocks are in. It is plain data: `to_dict`/`from_dict` give msgpack-able values, and `from_dict`
rejects a malformed description with a typed error instead of building a broken request. The wire
format around it (version, payload parts, grammar state) belongs to `cluster.protocol`.

Prefix caching through the hand-over: the decode side may already hold the prompt's first blocks (its own
prefix cache; it pinned them before the payload moved, engine/handovers.py `pin`). `reused_blocks` names how
many: the payload then carries the blocks from that index on, and the receiver's table starts with its own.
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
    # Per layer and token the KV is cache_planes x heads x cache_head_dim (engine/layers/kv_spec.py: K and V heads,
    # or MLA's one latent row); the receiving rank's heads are its own (its slice, or all of them).
    cache_planes: int
    cache_head_dim: int
    speculative_method: str | None = None  # the prefill side's draft method; None without speculation
    reused_blocks: int = 0  # leading prompt blocks the receiver holds already: the payload starts after them

    @property
    def num_blocks(self) -> int:
        """Blocks covering the computed tokens: the reused ones, then the payload's."""
        return -(-self.num_computed_tokens // self.block_size)

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
            "cache_planes": self.cache_planes,
            "cache_head_dim": self.cache_head_dim,
            "speculative_method": self.speculative_method,
            "reused_blocks": self.reused_blocks,
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
                cache_planes=_typed(d, "cache_planes", int),
                cache_head_dim=_typed(d, "cache_head_dim", int),
                speculative_method=d.get("speculative_method"),
                reused_blocks=_typed(d, "reused_blocks", int),
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
        if req.block_size <= 0:
            raise InvalidRequestError(f"hand-over block size must be positive, got {req.block_size}", param="handover")
        if not 0 <= req.reused_blocks <= max_reusable_blocks(len(req.prompt_token_ids), req.block_size):
            raise InvalidRequestError(f"hand-over of {req.request_id!r} reuses {req.reused_blocks} blocks of a "
                                      f"{len(req.prompt_token_ids)}-token prompt in {req.block_size}-token blocks: "
                                      f"the block holding its last token always travels", param="handover")
        return req


@dataclass(frozen=True, slots=True)
class HandoverDrafts:
    """A handed-over request's first drafts, drafted by the prefill side in the step that sampled its first
    token (its draft head is the decode side's: the same speculation), so the decode side's first step
    verifies them like any other request's, with no draft pass of its own before it."""
    token_ids: tuple[int, ...]  # the drafts after the first sampled token (a tree's nodes in depth order)
    # [n, V] f32 the chain's draft distributions, which lossless rejection sampling reads (sampled requests only)
    probs: torch.Tensor | None = None
    # a tree's shape (engine/speculative/tree.py DraftTree rows): parents [N], depth [N+1], ancestors [N+1]
    tree: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None
    # bit j set: token_ids[j] is a token the request's grammar forced (Request.spec_forced), which the decode side's
    # first step counts in usage as forced drafts, as the prefill side would have counted them
    forced: int = 0


@dataclass(frozen=True, slots=True)
class Handover:
    """A parked request and where its KV lives, as `LLMEngine.take_handover` gives it."""

    request: HandoverRequest
    block_ids: list[int]  # blocks holding the prompt's KV (target and draft layers), in order
    compiled_grammar: SerializedGrammar | None = None  # a guided request's compiled grammar, serialized
    drafts: HandoverDrafts | None = None  # the first drafts, drafted where the first token was sampled

    def reusing(self, reused_blocks: int) -> "Handover":
        """This hand-over for a receiver that holds the prompt's first `reused_blocks` blocks (capped so that
        the block holding the last prompt token, whose KV the receiver's first step extends, always travels)."""
        n = max(0, min(reused_blocks, max_reusable_blocks(len(self.request.prompt_token_ids),
                                                          self.request.block_size)))
        return dataclasses.replace(self, request=dataclasses.replace(self.request, reused_blocks=n))

    @property
    def payload_block_ids(self) -> list[int]:
        """The blocks whose KV travels: those past the reused ones, up to the last computed token."""
        return self.block_ids[self.request.reused_blocks:self.request.num_blocks]


def max_reusable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Leading full blocks of a prompt a receiver may hold instead of receiving: all but the one with the last
    prompt token (the same rule as the engine's prefix cache at admission)."""
    return max(0, (num_prompt_tokens - 1) // block_size)


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
