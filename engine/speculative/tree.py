"""Draft trees (EAGLE-2's dynamic trees) for the one-model heads, MTP and EAGLE-3: SpecConfig(topk > 1).

From each request's last verified row the head expands a tree of depth k: depth 1 holds the head's `topk` most
likely tokens; at each further depth the `topk` best nodes so far (the frontier, ranked by cumulative draft
log-probability) each run through the head and propose their `topk` best children, of which the `topk` best by
cumulative score form the next frontier. Of every node proposed, the `num_verify_tokens` (N) best by cumulative
score are verified next step. A child never scores above its parent and candidates are ranked stably in depth
order, so a node's parent is always among the chosen; the chosen nodes are put in depth order, each after its
parent, which is what lets the host cut a tree to its first n nodes near the model's length and keep a tree.

Why the N best by cumulative probability, and why that makes guided trees deep: a node's tokens are all emitted
only if the target agrees with every draft on its path, and the expected tokens a step accepts are the sum, over
the verified nodes, of those probabilities. With a calibrated head a path's probability is the product of its draft
probabilities, so the N nodes of largest cumulative probability are the N that maximize the expected accepted
length (a closed tree: a child never scores above its parent). The rule spends the budget where the probability
is, with no separate width or depth rule: where the head is confident the best nodes form one deep path (a chain),
where it is unsure they are siblings. Under a grammar the head's distribution is renormalized over what the grammar
admits, and a grammar-forced token (engine/masking/grammar.py: the node's only admissible child, or its forced
run's next token; handed over as a token, so one outside a reduced draft vocabulary too) has probability 1, so a
forced stretch keeps its parent's score and is chosen whenever its parent is: with depth k = N the tree reaches as
far as a chain of N drafts wherever the grammar decides, and branches only where the head is unsure. A shallower k
caps every path at k drafts, which under a grammar costs more than the width gains (bench/results/tree_vs_chain_cpu.md).

Shapes are fixed by (B, topk, k, N): k - 1 head passes of B * topk rows, one top-k per pass, and per depth one
fused launch for the bookkeeping (kernels/tree_expand.py: scores, forced flags, the next frontier by a stable rank,
its paths and lineage), then one for choosing the N best; on the CPU their torch references run. A forced
node's other topk - 1 candidates score -inf (never chosen while a finite one is left); its lanes still run, which
is what the fixed shape costs.

Where the frontier's KV lives: the head's pass at depth d writes the frontier's rows at KV positions
start + 1 + (d-1) * topk + lane (start: the last verified position), inside the request's lookahead slots
(SpecConfig.lookahead_slots), and attends with a tree mask (kernels/tree_mask.py): the prefix, and of the
frontier rows only its own ancestors. Those positions are past the verified tokens, so the next step's rows
overwrite them before anything else reads them, as a chain's drafts are.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from engine.layers.attention import AttentionMetadata, attention_context
from engine.speculative.tree_score import NUM_BUCKETS, AcceptanceTable
from kernels.draft_layout import draft_layout
from kernels.tree_expand import choose as choose_nodes
from kernels.tree_expand import expand_depth
from kernels.tree_rows import store_trees


@dataclass(frozen=True, slots=True)
class DraftTree:
    tokens: torch.Tensor  # [B, N] int64 node tokens (target ids), each node after its parent, in depth order
    parents: torch.Tensor  # [B, N] int64 node j+1's parent among nodes 0..j (0: the root)
    depth: torch.Tensor  # [B, N+1] int64 node depth (the root 0)
    ancestors: torch.Tensor  # [B, N+1] int64 bit i: node i is the node or one of its ancestors
    cells: torch.Tensor | None = None  # [B, N] int64 each node's AcceptanceTable cell (-1 or None: not scored)
    forced: torch.Tensor | None = None  # [B, N] bool the node is its parent's only admissible child (the grammar's)
    forced_word: torch.Tensor | None = None  # [B] int64 `forced` as bits: the choice sets both (kernels/tree_expand.py)

    def forced_bits(self) -> torch.Tensor:
        """[B] int64: bit j set where node j was forced (N <= 63 nodes fit), what the host counts as forced drafts."""
        if self.forced_word is not None:
            return self.forced_word
        return torch.zeros(self.tokens.shape[0], dtype=torch.int64, device=self.tokens.device)


class TreeSlots:
    """The tree each request carries into its next step, by draft-state slot (as the draft distributions of a
    chain are kept): its tokens travel through the host as the request's drafts, its shape stays here, read back with
    the step's rows (kernels/tree_rows.py)."""

    def __init__(self, num_slots: int, num_nodes: int, device: torch.device):
        self.num_nodes = num_nodes
        self.parents = torch.zeros((num_slots + 1, num_nodes), dtype=torch.int64, device=device)
        self.depth = torch.zeros((num_slots + 1, num_nodes + 1), dtype=torch.int64, device=device)
        self.ancestors = torch.ones((num_slots + 1, num_nodes + 1), dtype=torch.int64, device=device)
        self.cells = torch.full((num_slots + 1, num_nodes), -1, dtype=torch.int64, device=device)

    def write(self, slots: torch.Tensor, tree: DraftTree) -> None:
        store_trees(slots, tree.parents, tree.depth, tree.ancestors, tree.cells, self.parents, self.depth,
                    self.ancestors, self.cells)

    def grow(self, num_slots: int) -> None:
        for name in ("parents", "depth", "ancestors", "cells"):
            old = getattr(self, name)
            grown = old.new_full((num_slots + 1, old.shape[1]), -1 if name == "cells" else 0)
            grown[: old.shape[0]] = old
            setattr(self, name, grown)


@dataclass(frozen=True, slots=True)
class TreeShape:
    topk: int
    depth: int  # k
    num_nodes: int  # N, verified per request

    @property
    def margin(self) -> int:
        """KV positions the expansion reaches past the last verified one."""
        return (self.depth - 1) * self.topk + 1


class FrontierLayout:
    """Where the frontier rows of every depth live, computed once per expansion for every depth, in one launch on a GPU
    (kernels/draft_layout.py; per depth a pass only takes its slice): request b's depth-d lane g at KV position
    start + 1 + (d-1) * topk + g. Row i of that span is bit i of a row's lineage; the
    expansion's kernel (kernels/tree_expand.py) sets each new row's own bit and its tree mask."""

    def __init__(self, base: AttentionMetadata, kv_cache: torch.Tensor, start: torch.Tensor, depth: int, topk: int,
                 slot_limit: torch.Tensor, max_seq_len: int):
        tables = base.block_tables  # [B, M] int32
        # pass d (1 .. depth - 1) is the layout's pass d - 1: its topk rows from start + 1 + (d - 1) * topk
        self.slots, self.seq_lens, self.positions, self.query_start_loc = draft_layout(
            tables, start + 1, slot_limit, kv_cache.shape[3], depth - 1, topk)
        self.tables, self.kv_cache, self.topk, self.max_seq_len = tables, kv_cache, topk, max_seq_len

    def metadata(self, d: int, tree_mask: torch.Tensor) -> AttentionMetadata:
        """The head's pass over the depth-d frontier; tree_mask [B, topk] int64: each row's window of the frontier
        rows of depths 1..d (its ancestors and itself) and the prefix before them."""
        return AttentionMetadata(
            kv_cache=self.kv_cache, slot_mapping=self.slots[d - 1], block_tables=self.tables,
            seq_lens=self.seq_lens[d - 1], query_start_loc=self.query_start_loc, max_q_len=self.topk,
            max_seq_len=self.max_seq_len, tree_mask=tree_mask.reshape(-1))


# mask(paths [B, L, d] int64 target ids, logits [B * L, Vd]) -> forced [B, L] int64: constrains in place the draft
# logits of the L nodes per request reached by those paths after the step's emitted tokens (a grammar's masks along
# each node's path) and returns each node's grammar-forced child (-1: none)
TreeMask = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _log_probs(logits: torch.Tensor, paths: torch.Tensor, mask: TreeMask | None, unmasked: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> (log-probabilities [R, V], masked [R] bool: the grammar removed tokens from the row, forced [R] int64 or
    None: the row's forced child); unmasked: all-False flags of at least R rows, made once for every depth, for
    when there is no grammar (mask None)."""
    if mask is None:
        return logits.log_softmax(-1), unmasked[: logits.shape[0]], None
    forced = mask(paths, logits)
    # A row its mask closes entirely (a path the grammar refused at its end, or whose forced child is outside a
    # reduced draft vocabulary) scores -inf, never NaN.
    return (logits.log_softmax(-1).nan_to_num(nan=float("-inf")), torch.isneginf(logits).any(-1),
            forced.reshape(-1))


def expand(head, state: torch.Tensor, start: torch.Tensor, attn: AttentionMetadata, kv_cache: torch.Tensor,
           slot_limit: torch.Tensor, max_seq_len: int, shape: TreeShape, remap: torch.Tensor | None,
           mask: TreeMask | None = None, table: AcceptanceTable | None = None,
           sampled: torch.Tensor | None = None) -> DraftTree:
    """state [B, H]: the head's output at each request's last verified row (position start [B]) -> its tree.
    attn: the step's metadata (block tables); remap: target id of each draft id (None: the same vocabulary);
    mask: the grammar's, at every expansion (a node's candidates are what its path admits); table: scores nodes by
    estimated acceptance (None: by draft probability); sampled [B] bool: which requests sample (the table's class).
    Each depth's bookkeeping (scores, forced flags, the next frontier and its paths) is one fused kernel on a GPU
    (kernels/tree_expand.py); what stays here per depth is the head's pass, its top-k and the frontier's states."""
    K, k, N = shape.topk, shape.depth, shape.num_nodes
    B, H = state.shape
    dev = state.device
    sampled = sampled if sampled is not None else torch.zeros(B, dtype=torch.bool, device=dev)
    log_rate = table.log_rates() if table is not None else None  # kept current by the table itself
    unmasked = torch.zeros(B * K, dtype=torch.bool, device=dev) if mask is None else None  # one for every depth
    # every candidate's score, cell, forced flag, token and parent, each depth's written at its columns by its kernel:
    # what `choose` reads, with no concatenation (allocations are no launches)
    C = K + (k - 1) * K * K
    columns = (torch.empty((B, C), dtype=torch.float32, device=dev), torch.empty((B, C), dtype=torch.int64, device=dev),
               torch.empty((B, C), dtype=torch.bool, device=dev), torch.empty((B, C), dtype=torch.int64, device=dev),
               torch.empty((B, C), dtype=torch.int64, device=dev))

    def depth(logits, paths, d, frontier, offset):
        """The head's logits over R rows per request (the root's one, or the depth-d frontier's), reached by paths
        [B, R, d] -> the candidates' scores and the next frontier (frontier None: the root's expansion); the next
        frontier's rows sit at lineage bits d * K.. and its head pass sees (d + 1) * K frontier positions."""
        log_probs, masked, forced = _log_probs(logits, paths, mask, unmasked)
        R = log_probs.shape[0] // B
        lp, ids = log_probs.view(B, R, -1).topk(K, dim=-1)  # [B, R, K]: each row's best candidates
        root = frontier is None
        # a forced child (guided) takes its row's first candidate, inside the draft vocabulary or not
        return expand_depth(lp, ids, None if root else frontier["score"], None if root else frontier["candidate"],
                            masked.view(B, R), sampled, log_rate, NUM_BUCKETS, remap, None if root else paths,
                            None if root else frontier["lineage"], offset, d * K, (d + 1) * K, columns,
                            None if forced is None else forced.view(B, R))

    root = depth(head.compute_logits(state), torch.empty((B, 1, 0), dtype=torch.int64, device=dev), 0, None, 0)
    frontier = dict(tokens=root.next_tokens, score=root.best, state=state[:, None].expand(B, K, H),
                    path=root.path, candidate=root.candidate, lineage=root.lineage, tree_mask=root.tree_mask)
    offset = K
    layout = FrontierLayout(attn, kv_cache, start, k, K, slot_limit, max_seq_len) if k > 1 else None
    for d in range(1, k):
        with attention_context(layout.metadata(d, frontier["tree_mask"])):
            hidden = head(frontier["state"].reshape(B * K, H), frontier["tokens"].reshape(-1),
                          layout.positions[d - 1])  # [B * K, H]
        step = depth(head.compute_logits(hidden), frontier["path"], d, frontier, offset)
        frontier = dict(tokens=step.next_tokens, score=step.best, path=step.path, candidate=step.candidate,
                        lineage=step.lineage, tree_mask=step.tree_mask,
                        state=hidden.view(B, K, H).gather(1, step.lane[..., None].expand(B, K, H)))
        offset += K * K
    # each chosen node's depth follows from its parents (the choice's kernel counts the hops it follows anyway)
    scores, cells, forced, tokens, parents = columns
    return choose(tokens, scores, parents, None, N, cells, forced, max_depth=k)


def choose(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor | None,
           n: int, cells: torch.Tensor | None = None, forced: torch.Tensor | None = None,
           max_depth: int | None = None) -> DraftTree:
    """Candidates [B, C] (in depth order; parents: a candidate index, -1 for the root; depths [C] or None: each
    node's depth from its parents; cells: their table cells; forced: which the grammar forced; max_depth: a bound on
    their depths) -> the tree of the n best.
    A stable order keeps a parent before a child of equal score (a draft of probability 1), so the n best
    always hold every chosen node's parent (kernels/tree_expand.py `choose`: one launch on a GPU)."""
    return DraftTree(*choose_nodes(tokens, scores, parents, depths, n, cells, forced, max_depth))


def head_tree(proposer, inp, shape: TreeShape, mask: TreeMask | None = None) -> DraftTree | None:
    """A HeadProposer's tree proposal (engine/speculative/proposer.py): the head's first step over every row
    (its KV, and the state at each request's last verified row), then the expansion. None without `inp.chain`."""
    cache = proposer._kv_cache()
    with attention_context(replace(inp.attn, kv_cache=cache)):
        state = proposer.head(inp.hidden, inp.next_tokens, inp.positions)  # [R, H]
    if not inp.chain:
        return None
    start = inp.positions.index_select(0, inp.out_rows)
    return expand(proposer.head, state.index_select(0, inp.out_rows), start, inp.attn, cache, inp.slot_limit,
                  inp.max_seq_len + shape.margin, shape, proposer.remap, mask, proposer.tree_table,
                  inp.sampling.temperature > 0)
