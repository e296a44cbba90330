"""Grammar masks inside the captured step: the fills run as host functions between the step's kernels.

A CUDA graph replays kernels and copies with fixed addresses; the grammar work is Python (xgrammar
matchers). `StagedMasker` is the LogitsMasker a graph is captured with. Each fill the step asks for
becomes, on the step's stream:
    device -> pinned host copies of what the fill reads (this step's emitted tokens, accepted counts and
              the drafts so far; a chain's verification rows need only the host snapshot of begin_step, a draft
              tree's its parents, and a tree expansion's the paths of the nodes it expands),
    a host function: the real masker (`current`, set before each replay) fills pinned host bitmasks,
    pinned host -> device copies of the bitmask and its flags,
and the step then applies the mask as it does eagerly. So while the device runs the target's layers the
CPU is free, and the draft steps' masks cost one host round trip each, not a graph break.

The same order runs on CPU (host functions called in place, plain host buffers): the CPU tests exercise
this data flow through the padded graph layout, and a gpu test replays it in a real graph.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.masking.host_func import HostFunctions
from engine.masking.masker import LogitsMasker, MaskRow

if TYPE_CHECKING:  # the masking package imports nothing of speculation's at run time
    from engine.speculative.tree import TreeShape


class StagedMasker(LogitsMasker):
    def __init__(self, device: torch.device, max_batch: int, k: int, vocab_size: int, tree: TreeShape | None = None):
        """k: drafts verified per request (a tree's N nodes); tree: the draft trees' shape, for the buffers of their
        fills (None: chains)."""
        words = -(-vocab_size // 32)
        pin = device.type == "cuda"
        host = dict(device="cpu", pin_memory=pin)
        self.device = device
        self.host = HostFunctions(device)
        self.current: LogitsMasker | None = None  # the engine's masker for the step being replayed
        self.verify_bitmask = torch.zeros((max_batch, k + 1, words), dtype=torch.int32, **host)
        self.verify_flags = torch.zeros((max_batch, k + 1), dtype=torch.bool, **host)
        self.draft_bitmask = torch.zeros((max_batch, words), dtype=torch.int32, **host)
        self.draft_flags = torch.zeros(max_batch, dtype=torch.bool, **host)
        self.draft_forced = torch.full((max_batch,), -1, dtype=torch.int64, **host)
        self.emitted = torch.zeros((max_batch, k + 1), dtype=torch.int64, **host)
        self.accepted = torch.zeros(max_batch, dtype=torch.int64, **host)
        self.drafts = torch.zeros((max(k, 1), max_batch), dtype=torch.int64, **host)
        self.tree = _TreeBuffers(max_batch, k, tree, words, host) if tree is not None else None

    # The engine's masker takes its snapshot itself (ModelRunner._begin_masks); these are never called.
    def begin_step(self, rows: tuple[MaskRow, ...]) -> bool:
        raise AssertionError("StagedMasker only stands in for the engine's masker inside a step")

    # ------------------------------------------------------------------ in the step (captured)
    def clear_forced(self, forced: torch.Tensor) -> None:
        """Nothing on the device: fill_draft's host function sets every row of its host copy, which then replaces
        `forced` whole (a memset here would be one more graph node per draft step)."""
    def fill_verify(self, bitmask: torch.Tensor, flags: torch.Tensor) -> None:
        B, k1 = flags.shape
        h_bits, h_flags = self.verify_bitmask[:B, :k1], self.verify_flags[:B, :k1]
        self.host.launch(lambda: self._verify_on_host(h_bits, h_flags))
        bitmask.copy_(h_bits, non_blocking=True)
        flags.copy_(h_flags, non_blocking=True)

    def fill_draft(self, step: int, emitted: torch.Tensor, num_accepted: torch.Tensor, drafts: list[torch.Tensor],
                   bitmask: torch.Tensor, flags: torch.Tensor, forced: torch.Tensor) -> None:
        B, k1 = emitted.shape
        h_emitted, h_accepted = self.emitted[:B, :k1], self.accepted[:B]
        h_drafts = [self.drafts[i, :B] for i in range(len(drafts))]
        h_emitted.copy_(emitted, non_blocking=True)
        h_accepted.copy_(num_accepted, non_blocking=True)
        for h, d in zip(h_drafts, drafts):
            h.copy_(d, non_blocking=True)
        h_bits, h_flags, h_forced = self.draft_bitmask[:B], self.draft_flags[:B], self.draft_forced[:B]
        self.host.launch(lambda: self._draft_on_host(step, h_emitted, h_accepted, h_drafts, h_bits, h_flags,
                                                     h_forced))
        bitmask.copy_(h_bits, non_blocking=True)
        flags.copy_(h_flags, non_blocking=True)
        forced.copy_(h_forced, non_blocking=True)

    def fill_verify_tree(self, bitmask: torch.Tensor, flags: torch.Tensor, parents: torch.Tensor) -> None:
        B, n1 = flags.shape
        h_parents = _view(self.tree.parents, parents.shape)
        h_parents.copy_(parents, non_blocking=True)
        h_bits, h_flags = self.verify_bitmask[:B, :n1], self.verify_flags[:B, :n1]  # n1 = N + 1: contiguous
        self.host.launch(lambda: self._verify_tree_on_host(h_parents, h_bits, h_flags))
        bitmask.copy_(h_bits, non_blocking=True)
        flags.copy_(h_flags, non_blocking=True)

    def fill_draft_tree(self, emitted: torch.Tensor, num_accepted: torch.Tensor, paths: torch.Tensor,
                        bitmask: torch.Tensor, flags: torch.Tensor, forced: torch.Tensor) -> None:
        t = self.tree
        h_emitted, h_accepted = _view(t.emitted, emitted.shape), self.accepted[: emitted.shape[0]]
        h_paths = _view(t.paths, paths.shape)  # the root's expansion: [B, 1, 0], nothing to copy
        h_emitted.copy_(emitted, non_blocking=True)
        h_accepted.copy_(num_accepted, non_blocking=True)
        h_paths.copy_(paths, non_blocking=True)
        h_bits, h_flags = _view(t.bitmask, bitmask.shape), _view(t.flags, flags.shape)
        h_forced = _view(t.forced, forced.shape)
        self.host.launch(lambda: self._draft_tree_on_host(h_emitted, h_accepted, h_paths, h_bits, h_flags,
                                                          h_forced))
        bitmask.copy_(h_bits, non_blocking=True)
        flags.copy_(h_flags, non_blocking=True)
        forced.copy_(h_forced, non_blocking=True)

    # ------------------------------------------------------------------ on the host, when the stream gets there
    def _verify_on_host(self, bits: torch.Tensor, flags: torch.Tensor) -> None:
        flags.zero_()
        if self.current is not None:  # None while a graph is warmed up and captured: nothing is masked
            self.current.fill_verify(bits, flags)

    def _draft_on_host(self, step, emitted, accepted, drafts, bits, flags, forced) -> None:
        flags.zero_()
        forced.fill_(-1)
        if self.current is not None:
            self.current.fill_draft(step, emitted, accepted, drafts, bits, flags, forced)

    def _verify_tree_on_host(self, parents, bits, flags) -> None:
        flags.zero_()
        if self.current is not None:
            self.current.fill_verify_tree(bits, flags, parents)

    def _draft_tree_on_host(self, emitted, accepted, paths, bits, flags, forced) -> None:
        flags.zero_()
        forced.fill_(-1)
        if self.current is not None:
            self.current.fill_draft_tree(emitted, accepted, paths, bits, flags, forced)

    # ------------------------------------------------------------------ around a replay
    def bind(self, masker: LogitsMasker) -> None:
        self.current = masker

    def finish(self) -> None:
        """After the replay: wait for the stream with the GIL released, unbind, raise a failed fill."""
        try:
            self.host.sync()
        finally:
            self.current = None


class _TreeBuffers:
    """Host buffers of the draft trees' fills, flat and sized for the largest graph batch: each fill takes the
    leading elements as its own shape (a contiguous view, so the non-blocking copies land in place: a strided
    slice of a [max_batch, ...] buffer would not be, as its columns vary with the expansion's depth)."""

    def __init__(self, max_batch: int, n: int, shape: TreeShape, words: int, host: dict):
        lanes = max_batch * shape.topk  # the expansion's widest call: topk lanes per request
        self.parents = torch.zeros(max_batch * n, dtype=torch.int64, **host)
        self.emitted = torch.zeros(max_batch * (shape.depth + 1), dtype=torch.int64, **host)
        self.paths = torch.zeros(lanes * max(shape.depth - 1, 1), dtype=torch.int64, **host)  # depths 1 .. k-1
        self.bitmask = torch.zeros(lanes * words, dtype=torch.int32, **host)
        self.flags = torch.zeros(lanes, dtype=torch.bool, **host)
        self.forced = torch.full((lanes,), -1, dtype=torch.int64, **host)


def _view(flat: torch.Tensor, shape) -> torch.Tensor:
    """The first elements of a flat host buffer as `shape` (contiguous)."""
    n = 1
    for d in shape:
        n *= d
    return flat[:n].view(tuple(shape))
