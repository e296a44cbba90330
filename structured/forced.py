"""Grammar-forced tokens: the tokens a request's grammar decides on its own, which speculation drafts
for free (engine/masking/grammar.py puts them in the draft steps, engine/speculative/drafter.py in front of
prompt lookup's drafts).

Under a JSON schema much of the output is decided by the grammar alone: keys, quotes, colons, braces.
The grammar forces a STRING (xgrammar's jump-forward string), not a tokenization: after `{` the string
`"name": "` may be written as `"`, `name`, `":`, ` "` or as `"name`, `":`, ... and the mask admits every
one of them, so a mask with a single admissible token finds almost nothing there. A model writes the
tokenization its tokenizer would, so the forced string is retokenized canonically. Its end is the
pitfall: what follows the string may merge with its last characters (` "` followed by `John` stays
` "`, `John`, but `"` followed by `,` becomes `",`), so the run stops before the string's last
pre-token (the tokenizer's pre-tokenizer splits text into words that BPE never merges across; only the
last word can grow into what follows). The start cannot be redone: the tokens before it are emitted.

Forced tokens are drafts, verified as any draft is, so a wrong guess costs acceptance, never output.
Each is also checked against the grammar (and its state's extra mask) before it is drafted.
"""
from __future__ import annotations

from collections import OrderedDict

from structured.state import GrammarState


CONTEXT_TOKENS = 4  # emitted tokens retokenized with a forced string (a word it continues starts among them)


class ForcedTokenizer:
    """Canonical tokens of forced strings after the tokens emitted before them, cut before the string's
    last pre-token; cached (the same keys and separators recur at every step of every request)."""

    def __init__(self, tokenizer, max_cached: int = 8192):
        """tokenizer: a Hugging Face tokenizer with a fast (Rust) backend; without one nothing is forced
        by string (single admissible tokens still are)."""
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        self._cache: OrderedDict[tuple[tuple[int, ...], str], tuple[int, ...]] = OrderedDict()
        self._max_cached = max_cached

    def tokens(self, text: str, context: tuple[int, ...] = ()) -> tuple[int, ...]:
        """The canonical tokens of `text` that no continuation of it can change, written after the
        emitted tokens `context` (the last CONTEXT_TOKENS are used)."""
        if not text or self._backend is None:
            return ()
        context = tuple(context[-CONTEXT_TOKENS:])
        key = (context, text)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        run = self._retokenize(text, context)
        self._cache[key] = run
        if len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return run

    def _retokenize(self, text: str, context: tuple[int, ...]) -> tuple[int, ...]:
        # A forced string may start inside a word (`{"set` emitted, `tings": ` forced): its canonical
        # tokens are those of the whole word, so it is tokenized after the emitted tail, the longest tail
        # whose own tokens come back unchanged (else the emitted text is not canonical there, or merges
        # into the string, and the string alone is the best guess).
        for n in range(len(context), -1, -1):
            tail = self._tokenizer.decode(list(context[len(context) - n:])) if n else ""
            if "\ufffd" in tail:  # a character split across tokens: no text to retokenize with
                continue
            enc = self._backend.encode(tail + text, add_special_tokens=False)
            if n and tuple(enc.ids[:n]) != context[len(context) - n:]:
                continue
            words = enc.word_ids
            last = words[-1] if words else None
            # Without pre-token boundaries (word ids None) any merge may reach across: nothing is safe.
            cut = n if last is None else next(i for i, w in enumerate(words) if w == last)
            return tuple(enc.ids[n:cut])
        return ()


def forced_run(state: GrammarState, tokenizer: ForcedTokenizer, limit: int, context: tuple[int, ...] = (),
               bitmask=None) -> list[int]:
    """Up to `limit` tokens the grammar forces after `state`'s tokens (the last of them `context`),
    leaving the state where it was: the canonical tokens of the jump-forward string (ForcedTokenizer),
    and, with `bitmask` (a [1, W] int32 CPU scratch row), every point where the mask admits exactly one
    token. Without `bitmask` the run ends where the string's tokens end (the step's draft masks find
    single tokens themselves)."""
    run: list[int] = []
    try:
        while len(run) < limit and not state.terminated:
            before = len(run)
            for token in tokenizer.tokens(state.jump_forward_string(), context + tuple(run)):
                if len(run) >= limit or not state.admits(token) or not state.accept(token):
                    break
                run.append(token)
            if len(run) > before:  # what is left of the string is its last pre-token: cut again, to nothing
                continue
            if bitmask is None:
                break
            token = single_token(state, bitmask)
            if token is None or not state.accept(token):
                break
            run.append(token)
    finally:
        state.rollback(len(run))
    return run


def single_token(state: GrammarState, bitmask) -> int | None:
    """The one token the grammar admits next, or None when it admits several (or none)."""
    state.fill_bitmask(bitmask, 0)
    row = bitmask[0]
    nonzero = row.nonzero()
    if nonzero.numel() != 1:
        return None
    word = int(nonzero[0, 0])
    bits = int(row[word]) & 0xFFFFFFFF
    if bits & (bits - 1):  # more than one bit in the word
        return None
    return word * 32 + bits.bit_length() - 1
