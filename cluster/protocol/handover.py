"""The hand-over header: what a prefill tells a decode rank before the KV payload follows.

On the channel (cluster.channel) a message is a header frame and then, if the receiver answers "send",
the payload tensors in order. For a hand-over the header frame carries `HandoverHeader.to_wire()`:

    msgpack map {
      "version": HANDOVER_VERSION,     # checked first: prefill and decode must speak the same protocol
      "request": {...},                # engine.HandoverRequest.to_dict(): tokens, params, seed, cache layout,
                                       #   reused_blocks (leading blocks the receiver holds: "kv" starts after them)
      "parts":   ["kv", ...],          # the payload tensors' names, in the order they are sent
      "grammar": {...} | nil,          # GrammarHandover of a guided request: its backend and compiled grammar
      "drafts":  {...} | nil,          # DraftsHandover with speculation: the first drafts, drafted by the prefill
                                       #   in the step that sampled the first token (engine/handover.py), a tree's
                                       #   shape, and which of them the grammar forced (bits, counted in usage)
    }

The payload is reached by name (`HandoverPayload.kv`, `.draft_probs`), never by position. A header
that is not this (wrong version, missing or mistyped field, cut short) raises HandoverHeaderError, which
names what is wrong and, when it can be read, the request it belonged to.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgpack

from cluster.errors import HandoverHeaderError
from engine.errors import InvalidRequestError
from engine.handover import HandoverDrafts, HandoverRequest
from structured.request import BACKENDS, SerializedGrammar

if TYPE_CHECKING:
    import torch

# Bump on any change to the fields below or to HandoverRequest's (3: GrammarHandover.backend; 4: no "draft_kv"
# part, which no draft ever sent: a draft keeping a cache of its own gets its part when one is built;
# 5: HandoverRequest.reused_blocks, the leading blocks the receiver holds already and the payload skips;
# 6: HandoverRequest.cache_planes and cache_head_dim, so an MLA latent row and K/V heads cannot be confused;
# 7: "drafts" and the "draft_probs" part instead of "draft_hidden": the prefill drafts, the decode side verifies;
# 8: "drafts.forced", which of the first drafts the grammar forced, so the decode side counts them in usage).
HANDOVER_VERSION = 8


class PayloadPart(str, enum.Enum):
    KV = "kv"  # [L, P, n, S, h, D] the request's blocks past its reused ones (n = num_blocks - reused_blocks): the
    #            target's cache layers, then a cache-sharing draft's; P planes (2: K and V; 1: MLA's latent row), h
    #            the receiving rank's heads (its slice; all of them under ADP; MLA: the one latent, on every rank)
    # [n, V] f32 the first drafts' distributions, which the decode side's rejection sampling reads (a sampled
    # request's chain; greedy verification and trees read none)
    DRAFT_PROBS = "draft_probs"


@dataclass(frozen=True, slots=True)
class HandoverPayload:
    """The tensors of one hand-over, by name. Every rank gets its KV heads of `kv` (RankEndpoint.kv_heads) and the
    rest whole."""
    kv: torch.Tensor
    draft_probs: torch.Tensor | None = None

    @property
    def parts(self) -> tuple[PayloadPart, ...]:
        return tuple(p for p in PayloadPart if getattr(self, p.value) is not None)

    @property
    def tensors(self) -> list[torch.Tensor]:
        """In `parts` order: what the channel sends."""
        return [getattr(self, p.value) for p in self.parts]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @staticmethod
    def assemble(parts: tuple[PayloadPart, ...], tensors: list[torch.Tensor]) -> "HandoverPayload":
        """The received tensors, named by the header's `parts`."""
        if len(parts) != len(tensors):
            raise HandoverHeaderError(f"the header names {len(parts)} payload parts but {len(tensors)} tensors came")
        return HandoverPayload(**{p.value: t for p, t in zip(parts, tensors)})


@dataclass(frozen=True, slots=True)
class GrammarHandover:
    """A guided request's grammar, so the decode rank need not compile it again. The matcher is rebuilt
    from the request's own output tokens (HandoverRequest.output_token_ids: exactly the tokens the
    prefill's matcher accepted), which the header carries."""
    cache_key: str  # structured.request.StructuredOutput.key(): the content hash both sides cache compilations by
    compiled: str | None  # SerializedGrammar.text; None: the receiver compiles (or has it cached)
    backend: str = "xgrammar"  # SerializedGrammar.backend: which library loads `compiled` ("xgrammar", "llguidance")

    @staticmethod
    def of(cache_key: str, serialized: SerializedGrammar | None, backend: str) -> "GrammarHandover":
        return GrammarHandover(cache_key, serialized.text if serialized is not None else None,
                               serialized.backend if serialized is not None else backend)

    @property
    def serialized(self) -> SerializedGrammar | None:
        return SerializedGrammar(self.backend, self.compiled) if self.compiled is not None else None

    def to_wire(self) -> dict:
        return {"cache_key": self.cache_key, "backend": self.backend, "compiled": self.compiled}

    @staticmethod
    def from_wire(raw: object) -> "GrammarHandover":
        fields = _fields(raw, "grammar", {"cache_key", "backend", "compiled"})
        cache_key, backend, compiled = fields["cache_key"], fields["backend"], fields["compiled"]
        if not isinstance(cache_key, str):
            raise HandoverHeaderError(f"hand-over field 'grammar.cache_key' must be str, got {type(cache_key).__name__}")
        if backend not in BACKENDS:
            raise HandoverHeaderError(f"hand-over field 'grammar.backend' must be one of {list(BACKENDS)}, "
                                      f"got {backend!r}")
        if compiled is not None and not isinstance(compiled, str):
            raise HandoverHeaderError(f"hand-over field 'grammar.compiled' must be str or nil, "
                                      f"got {type(compiled).__name__}")
        return GrammarHandover(cache_key, compiled, backend)


@dataclass(frozen=True, slots=True)
class DraftsHandover:
    """A hand-over's first drafts as the header carries them (HandoverDrafts without its distributions, which
    travel as the DRAFT_PROBS payload part)."""
    token_ids: tuple[int, ...]
    tree: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None = None  # parents, depth, ancestors
    # bit j set: token_ids[j] was forced by the request's grammar (HandoverDrafts.forced; a tree's node j+1). On the
    # wire an int below 2 ** len(token_ids) (a tree has at most 63 nodes: it fits msgpack's int64)
    forced: int = 0

    @staticmethod
    def of(drafts: HandoverDrafts | None) -> "DraftsHandover | None":
        return None if drafts is None else DraftsHandover(drafts.token_ids, drafts.tree, drafts.forced)

    def with_probs(self, probs: torch.Tensor | None) -> HandoverDrafts:
        return HandoverDrafts(self.token_ids, probs, self.tree, self.forced)

    def to_wire(self) -> dict:
        return {"token_ids": list(self.token_ids), "tree": None if self.tree is None else [list(r) for r in self.tree],
                "forced": self.forced}

    @staticmethod
    def from_wire(raw: object) -> "DraftsHandover":
        fields = _fields(raw, "drafts", {"token_ids", "tree", "forced"})
        token_ids, tree, forced = fields["token_ids"], fields["tree"], fields["forced"]
        if not _ints(token_ids):
            raise HandoverHeaderError(f"hand-over field 'drafts.token_ids' must be a list of int, got {token_ids!r}")
        if tree is not None and not (isinstance(tree, list) and len(tree) == 3 and all(_ints(r) for r in tree)):
            raise HandoverHeaderError(f"hand-over field 'drafts.tree' must be nil or three lists of int "
                                      f"(parents, depth, ancestors), got {tree!r}")
        if not (isinstance(forced, int) and not isinstance(forced, bool) and 0 <= forced < 1 << len(token_ids)):
            raise HandoverHeaderError(f"hand-over field 'drafts.forced' must be an int of one bit per draft "
                                      f"(0 <= forced < 2 ** {len(token_ids)}), got {forced!r}")
        return DraftsHandover(tuple(token_ids), None if tree is None else tuple(tuple(r) for r in tree), forced)


def _ints(raw: object) -> bool:
    return isinstance(raw, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in raw)


@dataclass(frozen=True, slots=True)
class HandoverHeader:
    request: HandoverRequest
    parts: tuple[PayloadPart, ...]  # the payload's tensors, in the order they follow the header
    grammar: GrammarHandover | None = None
    drafts: DraftsHandover | None = None
    version: int = HANDOVER_VERSION

    def __post_init__(self) -> None:
        assert self.parts and self.parts[0] is PayloadPart.KV and len(set(self.parts)) == len(self.parts), self.parts

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def to_wire(self) -> bytes:
        return msgpack.packb({"version": self.version, "request": self.request.to_dict(),
                              "parts": [p.value for p in self.parts],
                              "grammar": None if self.grammar is None else self.grammar.to_wire(),
                              "drafts": None if self.drafts is None else self.drafts.to_wire()}, use_bin_type=True)

    @staticmethod
    def from_wire(data: bytes) -> "HandoverHeader":
        """Raises HandoverHeaderError saying what is wrong with `data`."""
        if not isinstance(data, (bytes, bytearray)):
            raise HandoverHeaderError(f"a hand-over header is msgpack bytes, got {type(data).__name__}")
        try:
            raw = msgpack.unpackb(data, raw=False, strict_map_key=False)
        except (ValueError, msgpack.exceptions.UnpackException) as e:  # truncated or not msgpack at all
            raise HandoverHeaderError(f"the hand-over header is not valid msgpack ({type(e).__name__}: {e})") from None
        request = raw.get("request") if isinstance(raw, dict) else None
        request_id = request.get("request_id") if isinstance(request, dict) else None
        request_id = request_id if isinstance(request_id, str) else None
        try:
            return _header(raw)
        except HandoverHeaderError as e:
            raise HandoverHeaderError(e.message, request_id=request_id) from None


def _header(raw: object) -> HandoverHeader:
    fields = _fields(raw, "header", {"version", "request", "parts", "grammar", "drafts"})
    version = fields["version"]
    if version != HANDOVER_VERSION:
        raise HandoverHeaderError(f"hand-over header version {version!r}, this rank speaks {HANDOVER_VERSION}: "
                                  f"prefill and decode run different Tandem versions")
    if not isinstance(fields["request"], dict):
        raise HandoverHeaderError(f"hand-over field 'request' must be a map, got {type(fields['request']).__name__}")
    try:
        request = HandoverRequest.from_dict(fields["request"])
    except InvalidRequestError as e:
        raise HandoverHeaderError(e.message) from None
    names = fields["parts"]
    known = {p.value for p in PayloadPart}
    if (not isinstance(names, list) or not names or names[0] != PayloadPart.KV.value
            or not all(isinstance(n, str) and n in known for n in names) or len(set(names)) != len(names)):
        raise HandoverHeaderError(f"hand-over field 'parts' must list distinct payload parts {sorted(known)} "
                                  f"starting with 'kv', got {names!r}")
    grammar = None if fields["grammar"] is None else GrammarHandover.from_wire(fields["grammar"])
    drafts = None if fields["drafts"] is None else DraftsHandover.from_wire(fields["drafts"])
    if PayloadPart.DRAFT_PROBS.value in names and drafts is None:
        raise HandoverHeaderError("the hand-over sends draft distributions but no drafts")
    return HandoverHeader(request, tuple(PayloadPart(n) for n in names), grammar, drafts, version)


def _fields(raw: object, what: str, names: set[str]) -> dict:
    """`raw` as a map with exactly `names` (a field sent and never read is a protocol bug, not a spare)."""
    if not isinstance(raw, dict):
        raise HandoverHeaderError(f"hand-over {what} must be a map, got {type(raw).__name__}")
    missing, unknown = names - raw.keys(), raw.keys() - names
    if missing:
        raise HandoverHeaderError(f"hand-over {what} lacks field(s) {sorted(missing)}")
    if unknown:
        raise HandoverHeaderError(f"hand-over {what} has unknown field(s) {sorted(map(str, unknown))}")
    return raw
