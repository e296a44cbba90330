"""The engine's step with draft trees (SpecConfig(topk > 1)): engine/runner/step.py's model_step for trees.

A decoding request's rows are its verified token (the root) and its N tree nodes in depth order
(engine/speculative/tree.py), laid out as a chain's would be: row j at KV position start + j. Then:

1. the target runs every row with each node at position start + depth and a tree mask (kernels/tree_mask.py):
   a node attends to the prefix and its ancestors only;
2. verification along the tree (tree_verify.py) gives the accepted path, emitted as a chain's tokens;
3. the path is made a chain: the target's KV of the path's nodes moves to positions start + 1.., and the rows
   are permuted so that row j holds the path's j-th node (hidden state, token after it); from here on the step
   is a chain's that accepted `a` drafts: the scheduler keeps a + 1 positions and rewinds the rest (the rejected
   nodes' slots are freed by lengths), and the head drafts from the last accepted row;
4. the head fills its KV over the permuted rows and expands the next tree, kept by slot in TreeSlots.

With nodes ranked by the acceptance table (tree_score.py), step 2's outcomes update it before step 4 expands. Under
attention data parallelism every rank's outcomes are gathered first (`share`, `group_outcomes`) and every rank,
an idle one too (`idle_outcomes`), updates its table with all of them: the tables stay equal to the one a single
process running every request would learn, so the group drafts the trees that process would. The table's counts
are sums of 0s and 1s, so the order the ranks' rows come in does not change them.

No host syncs; shapes are fixed by (B, N, topk, k), so the step is captured in the engine's decode graphs
(engine/runner/graphs.py, padded to N + 1 rows per request), a guided one too: its grammar fills take the tree's
parents and paths as device tensors, which a captured step stages to the host for its host functions
(engine/masking/graph.py). Under ADP a replayed graph gathers the outcomes of its padded batch, the same size on
every rank, instead of the agreed request count (a number a graph would have baked in at capture).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from engine.layers.attention import attention_context
from engine.masking.masker import LogitsMasker
from engine.models.llama import LlamaForCausalLM
from engine.runner.batch import StepBatch
from engine.speculative.proposer import ProposeInputs
from engine.speculative.tree import DraftTree, TreeShape, TreeSlots, head_tree
from engine.speculative.tree_verify import verify_tree
from kernels.bitmask import apply_token_bitmask
from kernels.tree_accept import accept_path
from kernels.tree_outcome import outcome
from kernels.tree_rows import tree_rows


def tree_layout(batch: StepBatch, slots: TreeSlots):
    """-> (the trees at the batch's slots, positions [T] with each node at start + depth, tree masks [T]): one launch
    on a GPU (kernels/tree_rows.py)."""
    rows = tree_rows(batch.verify_rows, batch.num_drafts, batch.slots, slots.parents, slots.depth, slots.ancestors,
                     slots.cells, batch.positions, batch.attn.seq_lens)
    return DraftTree(batch.drafts, rows.parents, rows.depth, rows.ancestors, rows.cells), rows.positions, rows.masks


def verify_mask(masker: LogitsMasker, batch: StepBatch, parents: torch.Tensor):
    """-> mask(logits [B * (N+1), V]) of the tree's verification rows: node j's row masked by the grammar state
    its path reaches. The masker gets the parents on the device: an eager one reads them itself, a captured step's
    (StagedMasker) copies them to the host ahead of its host function, so the step never syncs."""

    def mask(logits: torch.Tensor) -> None:
        batch.verify_mask_flags.zero_()
        masker.fill_verify_tree(batch.verify_bitmask, batch.verify_mask_flags, parents)
        apply_token_bitmask(logits, batch.verify_bitmask.flatten(0, 1), batch.verify_mask_flags.flatten())

    return mask


def expansion_mask(masker: LogitsMasker, batch: StepBatch, emitted: torch.Tensor, accepted: torch.Tensor,
                   d2t: torch.Tensor | None):
    """-> the TreeMask (tree.py) of the next tree's expansion: each node's candidates masked by the grammar state
    after this step's emitted tokens and the node's path (on the device, as verify_mask's parents)."""
    words = batch.verify_bitmask.shape[-1]

    def mask(paths: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        B, L, _ = paths.shape
        bitmask = torch.zeros((B, L, words), dtype=torch.int32, device=logits.device)
        flags = torch.zeros((B, L), dtype=torch.bool, device=logits.device)
        forced = torch.full((B, L), -1, dtype=torch.int64, device=logits.device)
        masker.fill_draft_tree(emitted, accepted, paths, bitmask, flags, forced)
        apply_token_bitmask(logits, bitmask.view(B * L, words), flags.view(-1), d2t=d2t)
        return forced

    return mask


# share(cells, reached, accepted) of this rank's [B, N] -> the group's [G, N] (rows of no node: cell -1, unreached)
Share = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def group_outcomes(dp, rows: int, cells: torch.Tensor, reached: torch.Tensor, accepted: torch.Tensor):
    """ADP: every rank's verification outcomes (a Share). dp: the DPContext; rows: what each rank pads its rows to,
    equal on every rank: the most requests a rank runs this step (the group's agreement) in an eager step, the
    padded batch size in a graph's (fixed per graph, which a graph may exceed the former by). One all-gather of
    [rows, 3N] int64."""
    n = cells.shape[1]
    packed = torch.cat([cells + 1, reached.long(), accepted.long()], 1)  # padding (zeros) reads as cell -1
    every = dp.gather_rows(packed, rows)
    return every[:, :n] - 1, every[:, n:2 * n].bool(), every[:, 2 * n:].bool()


def idle_outcomes(proposer, share: Share) -> None:
    """An ADP rank without rows this step: its table learns the group's outcomes too (its part is empty)."""
    if proposer.tree_table is not None:
        empty = torch.zeros((0, proposer.tree_shape.num_nodes), dtype=torch.int64,
                            device=proposer.tree_slots.parents.device)
        proposer.tree_table.observe(*share(empty, empty.bool(), empty.bool()))


def tree_model_step(target: LlamaForCausalLM, proposer, batch: StepBatch, masker: LogitsMasker | None,
                    draft_masks: bool = True, share: Share | None = None):
    """model_step (engine/runner/step.py) with draft trees; -> its StepOutput. draft_masks: the grammar masks the
    expansion too, not only the verification rows; share: under ADP, the group's outcomes from this rank's
    (group_outcomes), for the acceptance table."""
    from engine.runner.step import StepOutput

    shape: TreeShape = proposer.tree_shape
    slots: TreeSlots = proposer.tree_slots
    tree, positions, tree_mask = tree_layout(batch, slots)
    with attention_context(replace(batch.attn, tree_mask=tree_mask)):
        final, captured = target(batch.input_ids, positions, tuple(sorted(set(proposer.capture_layers))))
    vr = batch.verify_rows
    B, n1 = vr.shape
    logits = target.compute_logits(final.index_select(0, vr.reshape(-1))).view(B, n1, -1)
    grammar = verify_mask(masker, batch, tree.parents) if masker is not None else None
    v = verify_tree(logits, batch.drafts, tree.parents, tree.depth, tree.ancestors, batch.num_drafts,
                    batch.sampling, shape.depth, grammar)
    a = v.num_accepted
    if proposer.tree_table is not None:  # what this verification says about the scores the tree was chosen by
        seen = (tree.cells, *outcome(v.path, tree.parents, batch.num_drafts))
        proposer.tree_table.observe(*(share(*seen) if share is not None else seen))
    # the accepted path made a chain: its KV moved after the root, row c <- node path[c]'s row (kernels/tree_accept.py)
    acc = accept_path(batch.attn.kv_cache, batch.attn.slot_mapping, vr, v.path, a, batch.next_tokens, v.tokens,
                      batch.samples)
    hidden = proposer.first_hidden(final, captured)
    hidden = hidden.index_select(0, acc.perm) if hidden is not None else None
    tree_next = head_tree(proposer, ProposeInputs(
        hidden=hidden, input_ids=batch.input_ids.index_select(0, acc.perm), next_tokens=acc.next_tokens,
        positions=batch.positions, attn=batch.attn, out_rows=acc.out_rows, slot_limit=batch.slot_limit,
        max_seq_len=batch.chain_max_seq_len, chain=batch.propose, sampling=batch.sampling), shape,
        expansion_mask(masker, batch, v.tokens, a, proposer.d2t) if masker is not None and draft_masks else None)
    drafts = forced = None
    if tree_next is not None:
        slots.write(batch.slots, tree_next)
        drafts, forced = tree_next.tokens, tree_next.forced_bits()
    return StepOutput(v.tokens, a, drafts, v.logprobs, v.top_ids, v.top_logprobs, forced)
