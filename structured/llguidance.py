"""llguidance, the second grammar backend: JSON schemas xgrammar cannot be trusted with (issue 11,
enforce or refuse).

A json_schema request goes to llguidance exactly when structured.schema.support refuses it for xgrammar
(a keyword xgrammar would not enforce) and llguidance accepts it: llguidance refuses what it cannot
enforce itself (`Unimplemented keys`, oneOf unless coerced, unknown formats), so a grammar it builds
is enforced in full. Options: compact JSON (", " and ": ", no free whitespace), as xgrammar's compact
grammar writes it, and oneOf NOT coerced to anyOf (coercing would let an instance match two branches).

The schema llguidance compiles is the user's after structured/schema/rewrite.py's rewrites and the key-
presence rewrites of structured/schema/presence.py (dependencies, not-required, oneOf of required sets
or of disjoint branches as anyOf), all exact (structured.request.llguidance_schema).

What "compiled" means here: llguidance has no serialized compiled form. Its grammar is a JSON text
(the schema wrapped with its options, `grammar_text`), and building an LLMatcher from it builds the
lexer and parser for the tokenizer: measured on the JSONSchemaBench dev schemas it serves, with the
zoo tokenizer (4,096 tokens), p50 2 ms, p99 170 ms, worst 5.5 s (the GIL is released meanwhile).
So a compile validates the grammar in the compile process (time-limited: structured/compile_worker.py),
then builds one template matcher in this process, and `LLGuidanceGrammar` (the cached "compiled
grammar") holds both; each request's matcher is a deep copy of the template (microseconds). The
hand-over carries the grammar text, and the decode side builds its template once per content key
(a cache hit skips it): that build is llguidance's "deserialization".
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.errors import InvalidRequestError
from structured.state import GrammarState

if TYPE_CHECKING:
    import torch

try:
    import llguidance
except ImportError:  # pragma: no cover - a project dependency; without it such schemas stay refused
    llguidance = None

BACKEND = "llguidance"
# compact JSON as xgrammar's compact grammar writes it; oneOf exact (not coerced to anyOf)
OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": False}
# Bytes charged to the cache per grammar (llguidance reports no size): the grammar text and its
# lexer/parser, which grow with the text. Measured: 118 dev schemas llguidance serves, zoo tokenizer,
# template + one copy + one mask each: RSS +216 KB per grammar for 6.0 KB of text on average (36 B
# per character, base included); this estimate charges about 1.5x that.
_BYTES_PER_CHAR, _BASE_BYTES = 32, 128 * 2**10


def available() -> bool:
    return llguidance is not None


def grammar_text(schema) -> str:
    """The llguidance grammar (JSON text) of a JSON schema with the engine's options (they override
    any "x-guidance" the schema carries)."""
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=OPTIONS)


def tokenizer_of(tokenizer_json: str, vocab_size: int, stop_token_ids: list[int]):
    """An LLTokenizer from a HF fast tokenizer's JSON (`backend_tokenizer.to_str()`): the model's
    vocabulary size (bitmask width) and stop tokens, as xgrammar's TokenizerInfo gets them."""
    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(stop_token_ids))


def hf_tokenizer_json(tokenizer) -> str:
    """The JSON of a HF fast tokenizer without padding/truncation (what LLTokenizer reads)."""
    from copy import copy

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise InvalidRequestError("schemas served by llguidance need a fast (Rust) tokenizer",
                                  param="response_format")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()


_NEGATED_CLASS = re.compile(r"\[\^((?:\\.|[^\]\\])*)\]")


def escape_gap(schema) -> str | None:
    """A pattern llguidance would not enforce exactly, or None. Measured (JSONSchemaBench
    JsonSchemaStore libman, then by hand): a negated character class that excludes `"` or `\\`
    (`[^\\\\]`, `[^"]`, `[^\\x22]`) still lets the JSON escapes `\\\\` and `\\"` through, so a string
    holding the excluded character completes. Such patterns (in `pattern` or as patternProperties
    names) are refused; a class Python cannot read is refused too."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        regexes = [node["pattern"]] if isinstance(node.get("pattern"), str) else []
        if isinstance(node.get("patternProperties"), dict):
            regexes += list(node["patternProperties"])
        for regex in regexes:
            for body in _NEGATED_CLASS.findall(regex):
                try:
                    excluded = re.compile(f"[{body}]")
                except re.error:
                    return f"a negated character class it cannot read: [^{body}]"
                if excluded.fullmatch('"') or excluded.fullmatch("\\"):
                    return f"the negated class [^{body}] would admit the JSON escapes \\\\ and \\\""
        stack.extend(node.values())
    return None


def check_gaps(schema, refusal: str) -> None:
    """InvalidRequestError (both backends' reasons) for a schema with a pattern llguidance would not
    enforce exactly (`escape_gap`); its own validation does not see these."""
    gap = escape_gap(schema)
    if gap is not None:
        raise InvalidRequestError(f"{refusal}; llguidance cannot enforce it either ({gap})", param="response_format")


def validated(text: str, lltokenizer, refusal: str) -> str:
    """`text` if llguidance can enforce it for this tokenizer, else InvalidRequestError naming both
    backends' reasons (`refusal`: why xgrammar cannot)."""
    error = llguidance.LLMatcher.validate_grammar(text, lltokenizer)
    if error:
        reason = " ".join(error.split())[:300]
        raise InvalidRequestError(f"{refusal}; llguidance cannot enforce it either ({reason})",
                                  param="response_format")
    return text


@dataclass(frozen=True, slots=True)
class LLGuidanceGrammar:
    """The cached form of one llguidance grammar: its text (what a hand-over carries) and a template
    matcher at the start of the grammar, which new requests deep-copy."""

    text: str
    template: object  # llguidance.LLMatcher, never advanced

    @property
    def memory_size_bytes(self) -> int:
        """An estimate (structured/cache.py sizes entries by this attribute, as xgrammar's)."""
        return _BASE_BYTES + _BYTES_PER_CHAR * len(self.text)


def load(text: str, lltokenizer) -> LLGuidanceGrammar:
    """Build the template matcher (the costly part: module docstring); InvalidRequestError if it fails."""
    template = llguidance.LLMatcher(lltokenizer, text, log_level=0)
    if template.is_error():
        raise InvalidRequestError(f"llguidance cannot build the grammar: {template.get_error()[:300]}",
                                  param="response_format")
    return LLGuidanceGrammar(text, template)


class LLGuidanceState(GrammarState):
    """One request's llguidance matcher, with xgrammar's semantics (structured/state.py):

    - a rejected token leaves the state as it was (llguidance's consume_token would put the matcher in
      an error state for good, so tokens go through try_consume_tokens, which checks first);
    - a stop token is accepted only where the grammar may end, and only then is the state terminated;
      it is kept here, not in the matcher: llguidance, once the grammar cannot extend, takes EOS
      without recording it, so rolling it back would undo a real token.
    """

    def __init__(self, matcher, stop_token_ids: frozenset[int], extra_mask: torch.Tensor | None = None):
        self.matcher = matcher
        self.stop_token_ids = stop_token_ids
        self.extra_mask = extra_mask  # [ceil(V/32)] int32 ANDed into every row this state fills
        self._ended = False  # a stop token was accepted
        self._consumed = 0  # tokens the matcher holds (rollback never asks it for more)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import torch  # loaded already: `bitmask` is a tensor (this module is imported without torch)

        target = bitmask[row]
        # llguidance writes xgrammar's layout: int32 words, token t at bit t % 32 of word t // 32
        assert target.dtype == torch.int32 and target.device.type == "cpu" and target.is_contiguous()
        self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * 4)
        if self.extra_mask is not None:
            target &= self.extra_mask

    def accept(self, token_id: int) -> bool:
        if self._ended:
            return False
        if token_id in self.stop_token_ids:
            if not self.matcher.is_accepting():
                return False
            self._ended = True
            return True
        if self.matcher.try_consume_tokens([token_id]) != 1:
            return False
        self._consumed += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and self._ended:
            self._ended = False
            num_tokens -= 1
        if num_tokens:
            assert num_tokens <= self._consumed, (num_tokens, self._consumed)
            if not self.matcher.rollback(num_tokens):
                raise RuntimeError(f"llguidance rollback failed: {self.matcher.get_error()[:200]}")
            self._consumed -= num_tokens

    @property
    def terminated(self) -> bool:
        return self._ended

    def jump_forward_string(self) -> str:
        if self._ended:
            return ""
        forced = bytes(self.matcher.compute_ff_bytes())
        for cut in range(min(4, len(forced)) + 1):  # a UTF-8 character cut at its end is not forced yet
            try:
                return forced[: len(forced) - cut].decode("utf-8")
            except UnicodeDecodeError:
                continue
        return ""
