"""GrammarState: one request's position in its grammar, the seam between the step and a grammar backend.

The step (engine/masking/grammar.py) relies on xgrammar's matcher semantics, which every backend
keeps: `accept` of a token the grammar rejects returns False and changes nothing (speculation feeds
drafts that may be wrong); a stop token is accepted only where the grammar may end, and only that
makes the state `terminated` (the request then finishes with "stop"); `rollback(n)` undoes the last n
accepted tokens, a stop token included; `fill_bitmask` writes one row of int32 words, token t at bit
t % 32 of word t // 32 (kernels/bitmask.py), with the stop tokens allowed exactly where the grammar
may end.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class GrammarState(ABC):
    extra_mask: torch.Tensor | None = None  # [ceil(V/32)] int32 ANDed into every row the state fills

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask [R, ceil(V/32)] int32 on the CPU: row `row` := the tokens allowed next."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) if the grammar rejects it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @property
    @abstractmethod
    def terminated(self) -> bool:
        """A stop token was accepted at the grammar's end."""

    @abstractmethod
    def jump_forward_string(self) -> str:
        """The longest string every continuation of the grammar starts with from here (its forced
        text, structured/forced.py); the state is unchanged."""

    def admits(self, token_id: int) -> bool:
        """The state's extra mask lets `token_id` through (the grammar itself decides in `accept`)."""
        if self.extra_mask is None:
            return True
        return bool((int(self.extra_mask[token_id // 32]) >> (token_id % 32)) & 1)


class XGrammarState(GrammarState):
    """An xgrammar GrammarMatcher (its own semantics are the ones above)."""

    def __init__(self, matcher, extra_mask: torch.Tensor | None = None):
        self.matcher = matcher
        self.extra_mask = extra_mask  # [ceil(V/32)] int32 ANDed into every row this state fills

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)
        if self.extra_mask is not None:
            bitmask[row] &= self.extra_mask

    def accept(self, token_id: int) -> bool:
        return self.matcher.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self.matcher.rollback(num_tokens)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def jump_forward_string(self) -> str:
        return self.matcher.find_jump_forward_string()
