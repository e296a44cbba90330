"""Logits maskers: constraints on which tokens a step may emit (grammars, allowed-token sets).

A masker fills token bitmasks (xgrammar's packed int32 layout, see kernels/bitmask.py) for the rows
of a step; the step applies them between the logits and verification/sampling, and between each
draft step's logits and its sampling, so drafts are valid too and acceptance does not suffer:

  host, before launch   begin_step(rows)        snapshot of each request's drafts (never live objects)
  in the step           fill_verify(...)        rows (b, j): after the request's tokens and drafts[:j]
                        fill_draft(step, ...)   after the emitted tokens and the new drafts so far
  host, after the step  end_step(); accept(request_id, tokens) for what was emitted; release()

Eager steps call the fills inline, in order. A step that replays a CUDA graph is captured with
engine/masking/graph.py's StagedMasker instead: each fill becomes a host function on the step's stream
(captured in the graph) that calls this masker on pinned host copies of what it reads, and copies its
bitmask back; the same order runs in place on CPU. No speculation is k = 0: one verification row per
request, no draft steps, the same calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels.bitmask import apply_token_bitmask


@dataclass(frozen=True, slots=True)
class MaskRow:
    """One request of a step, as the masker sees it (a host snapshot taken before launch)."""

    request_id: str
    drafts: tuple[int, ...]  # drafts verified this step, in target ids (rows 1..len(drafts))
    samples: bool  # the request emits tokens this step; a prompt chunk that does not sample needs no mask


class LogitsMasker(ABC):
    """Per-request token constraints. Every tensor argument is on the step's device."""

    @abstractmethod
    def begin_step(self, rows: tuple[MaskRow, ...]) -> bool:
        """Host, before launch. Returns whether any row of this step is constrained (if not, the
        step runs without masks and no fill_* is called)."""

    @abstractmethod
    def fill_verify(self, bitmask: torch.Tensor, flags: torch.Tensor) -> None:
        """bitmask [B, k+1, W] int32, flags [B, k+1] bool (all False on entry): for request b, row j
        allows the tokens that may follow its tokens and its first j drafts. Rows after the first
        draft the constraint rejects may stay unflagged (that draft is rejected anyway)."""

    @abstractmethod
    def fill_draft(self, step: int, emitted: torch.Tensor, num_accepted: torch.Tensor, drafts: list[torch.Tensor],
                   bitmask: torch.Tensor, flags: torch.Tensor, forced: torch.Tensor) -> None:
        """Draft step `step` (0-based): emitted [B, k+1] int64 this step's verified tokens (-1 past
        num_accepted [B] + 1), drafts: `step` tensors [B] int64 of new drafts so far (target ids);
        fill bitmask [B, W] / flags [B] for the next draft, and forced [B] int64 (-1 on entry) with the token
        a request's constraint forces as that draft: the draft takes it whatever its network scores, so a
        token outside a reduced draft vocabulary is drafted too."""

    def clear_forced(self, forced: torch.Tensor) -> None:
        """Before fill_draft: forced := -1 (a masker whose fill writes every row overrides this with nothing)."""
        forced.fill_(-1)

    def fill_verify_tree(self, bitmask: torch.Tensor, flags: torch.Tensor, parents: torch.Tensor) -> None:
        """Draft trees (engine/speculative/tree.py): as fill_verify, with MaskRow.drafts a tree's nodes and
        parents [B, N] int64 (parents[b, j-1]: node j's parent, 0 the root): row j allows what may follow the
        request's tokens and the drafts on the path from the root to node j. parents is on the step's device, like
        every tensor here: the masker reads it on the host itself (a captured step hands it host copies)."""
        raise NotImplementedError(f"{type(self).__name__} does not mask draft trees")

    def fill_draft_tree(self, emitted: torch.Tensor, num_accepted: torch.Tensor, paths: torch.Tensor,
                        bitmask: torch.Tensor, flags: torch.Tensor, forced: torch.Tensor) -> None:
        """A draft tree's expansion at one depth d: emitted, num_accepted as fill_draft; paths [B, L, d] int64: lane
        l of request b expands the node reached by paths[b, l] (target ids after the emitted tokens); fill bitmask
        [B, L, W] / flags [B, L] for its children, and forced [B, L] int64 (-1 on entry) with a lane's only child
        where the constraint forces it (its one candidate, of probability 1, in the draft vocabulary or not)."""
        raise NotImplementedError(f"{type(self).__name__} does not mask draft trees")

    def end_step(self) -> None:
        """Host, after the step's outputs landed: drop what begin_step snapshotted."""

    def accept(self, request_id: str, token_ids: list[int]) -> None:
        """Host: tokens the engine emitted for a request (after verification and stop checks)."""

    def release(self, request_id: str) -> None:
        """Host: the request finished, was aborted or handed over; forget its state."""


class StepMasks:
    """A masker bound to one step's bitmask buffers (StepBatch.verify_bitmask and friends)."""

    def __init__(self, masker: LogitsMasker, batch):
        self.masker = masker
        self.batch = batch

    def verify(self, logits: torch.Tensor, width: int | None = None) -> None:
        """logits [B * width, V] (width: the chain columns verified, k+1 by default), masked in place."""
        b = self.batch
        b.verify_mask_flags.zero_()
        self.masker.fill_verify(b.verify_bitmask, b.verify_mask_flags)
        bitmask, flags = b.verify_bitmask, b.verify_mask_flags
        if width is not None and width < bitmask.shape[1]:  # filled for k+1 columns, applied to the first `width`
            bitmask, flags = bitmask[:, :width], flags[:, :width]
        apply_token_bitmask(logits, bitmask.flatten(0, 1), flags.flatten())

    def draft_step(self, emitted: torch.Tensor, num_accepted: torch.Tensor):
        """-> mask(step, drafts, logits [B, Vd], d2t) -> forced [B] for the draft loop: fills and applies the
        next draft's mask (d2t [Vd]: draft id j is target id j + d2t[j], or None) and returns the tokens forced
        as that draft (-1: none; masker.fill_draft)."""
        b = self.batch

        def mask(step: int, drafts: list[torch.Tensor], logits: torch.Tensor,
                 d2t: torch.Tensor | None) -> torch.Tensor:
            b.draft_mask_flags.zero_()
            self.masker.clear_forced(b.draft_forced)
            self.masker.fill_draft(step, emitted, num_accepted, drafts, b.draft_bitmask, b.draft_mask_flags,
                                   b.draft_forced)
            apply_token_bitmask(logits, b.draft_bitmask, b.draft_mask_flags, d2t=d2t)
            return b.draft_forced

        return mask
