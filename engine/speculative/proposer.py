"""Draft proposers that run inside the step: a one-model head (MTP, EAGLE-3) or a separate draft model.

Both fill their KV over every row the target ran this step (prompt chunks and verification chains),
then extend a chain of k drafts from each request's last verified row. All shapes are fixed by the
batch (rows T, requests B, k); positions and slots that depend on the number of accepted drafts
are computed on the device, so the whole proposal is capturable in a CUDA graph.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from typing import Callable

import torch

from engine.layers.attention import AttentionMetadata, PagedAttention, attention_context
from engine.layers.latent_attention import LatentPagedAttention
from engine.models.draft_head import DraftHead
from engine.models.llama import LlamaForCausalLM
from engine.sample.sampler import SamplingBatch, processed_logits, race
from kernels._dispatch import use_triton
from kernels.attention import cpu_kernel_serves, plan_chain
from kernels.draft_layout import draft_layout


@dataclass(frozen=True, slots=True)
class ProposeInputs:
    hidden: torch.Tensor | None  # [R, H_in] first-step hidden of a head (None for a draft model)
    input_ids: torch.Tensor  # [R] int64 the target's input tokens of the rows
    next_tokens: torch.Tensor  # [R] int64 the token after each row (the verified/sampled one where it matters)
    positions: torch.Tensor  # [R] int64
    attn: AttentionMetadata  # the target's metadata over the R rows (its kv_cache is swapped for the draft's)
    out_rows: torch.Tensor  # [B] int64 each request's last verified row: the chain starts after it
    slot_limit: torch.Tensor  # [B] int64 KV slots the request holds; chain writes at or past it are dropped
    max_seq_len: int  # host bound on positions + 1 over the chain
    chain: bool  # host: draft k tokens; False only fills the draft KV over the rows (prefill-only batches)
    sampling: SamplingBatch  # [B] rows; drafts use its temperature/top-k/top-p/min-p, not its penalties
    # mask(step, drafts so far, logits [B, Vd], d2t [Vd] | None) -> forced [B] int64: constrains a draft step's
    # logits in place before it samples and returns the tokens the grammar forces as that draft, -1 where none
    # (engine/masking/masker.py); None when no masker runs
    mask: Callable[[int, list[torch.Tensor], torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
    passes: int | None = None  # host: drafts the chain makes, 1..k (adaptive k); None: k


def chain_metadata(base: AttentionMetadata, kv_cache: torch.Tensor, first: torch.Tensor, passes: int,
                   slot_limit: torch.Tensor, max_seq_len: int, group: int) -> list[AttentionMetadata]:
    """The metadata of a draft chain's `passes` passes: pass p runs one query row per request at position
    first + p ([B]) over the requests' block tables. Made together for all passes, one set of index ops
    (and on a CPU the attention reference's plans, for heads of `group` query heads per KV head), rather than
    pass by pass: the chain's host cost is per step, not per draft."""
    if passes == 0:
        return []
    tables = base.block_tables  # [B, M] int32
    B, block_size = tables.shape[0], kv_cache.shape[3]
    # [P, B] each: pass p's row of request b at position first + p (one launch on a GPU)
    slot_mapping, seq_lens, _, query_start_loc = draft_layout(tables, first, slot_limit, block_size, passes, 1)
    if use_triton(kv_cache) or cpu_kernel_serves(kv_cache):  # kernels that read the tensors alone
        plans = [{} for _ in range(passes)]
    else:  # the reference path's plans, under the keys AttentionMetadata looks them up by
        plans = [{"store": store, (B, block_size, group): attend}
                 for store, attend in plan_chain(tables, seq_lens, slot_mapping, block_size, group, max_seq_len)]
    return [AttentionMetadata(kv_cache=kv_cache, slot_mapping=slot_mapping[p], block_tables=tables,
                              seq_lens=seq_lens[p], query_start_loc=query_start_loc, max_q_len=1,
                              max_seq_len=max_seq_len, plans=plans[p]) for p in range(passes)]


def attention_group(net: torch.nn.Module) -> int:
    """Query heads per KV head of a draft network's attention (every layer of it alike)."""
    return next(m.group for m in net.modules() if isinstance(m, (PagedAttention, LatentPagedAttention)))


def sample_drafts(logits: torch.Tensor, positions: torch.Tensor, s: SamplingBatch,
                  draft_to_target: torch.Tensor | None, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft logits [B, Vd] -> (draft token in target ids [B], its distribution q over the target vocab
    [B, V] or None when every row is greedy). Sampled rows draw from the sampler's processed
    distribution by the exponential race on the target's own STREAM_SAMPLE numbers of (seed, position)
    (a reduced draft vocabulary races at its target ids): the draft is the token the target would draw
    there if its p were q, so a coupled verification (engine/sample/verify.py) accepts it whenever q is
    near p. Rejection sampling stays lossless with these drafts: its acceptance test and residual draw have
    streams of their own, and the numbers at a position reach an emitted token only through the one draft
    (or the bonus, where no draft sits) that decides it. Greedy rows take the argmax.
    A request's logit bias applies to its drafts as to the target: q is then the distribution its draft
    was drawn from, and verification against the biased target stays lossless."""
    if s.logit_bias is not None:
        logits = logits + (s.logit_bias if draft_to_target is None else s.logit_bias[:, draft_to_target])
    if s.all_greedy:
        best = logits.argmax(-1)
        return (best if draft_to_target is None else draft_to_target[best]), None
    if draft_to_target is not None:
        full = logits.new_full((logits.shape[0], vocab_size), float("-inf"))
        logits = full.index_copy_(1, draft_to_target, logits)
    q = processed_logits(logits, s).softmax(-1)  # [B, V]; greedy rows never read it
    return torch.where(s.temperature > 0, race(q, s.seeds, positions), logits.argmax(-1)), q


def take_forced(forced: torch.Tensor, token: torch.Tensor, q: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """forced [B] int64 (-1: none): rows whose grammar forces their draft take that token, with q one-hot on it
    (the distribution it was drawn from; masked draft logits already give an in-vocabulary forced token q = 1,
    but an out-of-vocabulary one leaves them all -inf and q NaN). Fixed shapes, no host sync."""
    on = forced >= 0
    token = torch.where(on, forced, token)
    if q is not None:
        one_hot = torch.zeros_like(q).scatter_(1, forced.clamp(min=0)[:, None], 1.0)
        q = torch.where(on[:, None], one_hot, q)
    return token, q


class Proposer(ABC):
    """A draft network living beside the target in the engine's step."""

    k: int
    capture_layers: tuple[int, ...] = ()
    num_cache_layers: int  # KV layers it adds after the target's
    needs_hidden: bool  # its first step reads the target's hidden states (a head), not only tokens

    # Draft trees (SpecConfig(topk > 1), a head only): the tree's shape and the trees kept by draft-state slot
    # (engine/speculative/tree.py); None for chains
    tree_shape = None
    tree_slots = None
    tree_table = None  # AcceptanceTable (tree_score.py) when trees rank nodes by estimated acceptance
    remap: torch.Tensor | None = None  # [Vd] target id of each draft id, when the vocabularies differ
    # [slots + 1, H_in] a head's input of each KV slot, where its KV may be deferred (deferred_kv.py); else None
    stash: torch.Tensor | None = None
    d2t: torch.Tensor | None = None  # [Vd] the same map as offsets (target id = draft id + d2t): bitmask kernels

    def __init__(self, k: int, vocab_size: int, kv_cache_ref):
        self.k = k
        self.vocab_size = vocab_size
        self._kv_cache = kv_cache_ref  # callable -> the cache tensor holding the draft layers

    def first_hidden(self, final_hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor | None:
        return None

    @abstractmethod
    def propose(self, inp: ProposeInputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """-> (drafts [B, k] int64 target ids, draft distributions [B, k, V] or None if all greedy);
        (None, None) without `inp.chain`."""

    def passes(self, inp: ProposeInputs) -> int:
        return self.k if inp.passes is None else inp.passes

    def _chain(self, inp: ProposeInputs, step: Callable[[int, torch.Tensor | None], torch.Tensor]):
        """The k-step draft loop of every proposer: step(s, previous draft [B] or None) -> the draft
        network's logits [B, Vd] for draft s, which sits at position (last verified row) + 2 + s; each
        is masked (when a masker runs) and sampled; a token the grammar forces is the draft, of probability 1,
        even outside a reduced draft vocabulary (whose masked logits then admit nothing)."""
        first = inp.positions.index_select(0, inp.out_rows) + 2
        tokens, probs = [], []
        for s in range(self.passes(inp)):
            logits = step(s, tokens[-1] if tokens else None)
            forced = None if inp.mask is None else inp.mask(s, tokens, logits, self.d2t)
            token, q = sample_drafts(logits, first + s, inp.sampling, self.remap, self.vocab_size)
            if forced is not None:
                token, q = take_forced(forced, token, q)
            tokens.append(token)
            probs.append(q)
        return torch.stack(tokens, 1), (None if probs[0] is None else torch.stack(probs, 1))


class HeadProposer(Proposer):
    """MTP or EAGLE-3: the first step over all rows reads the target's hidden states, k-1 more steps
    read the head's own output, one row per request."""

    def __init__(self, head: DraftHead, k: int, vocab_size: int, kv_cache_ref):
        super().__init__(k, vocab_size, kv_cache_ref)
        self.head = head
        self.group = attention_group(head)
        self.capture_layers = head.capture_layers
        self.num_cache_layers = 1
        self.needs_hidden = True
        small = head.draft_vocab_size is not None and head.draft_vocab_size != vocab_size
        self.remap = head.draft_to_target if small else None
        self.d2t = self.remap - torch.arange(len(self.remap), device=self.remap.device) if small else None

    def first_hidden(self, final_hidden, captured):
        return self.head.first_hidden(final_hidden, captured)

    def propose(self, inp: ProposeInputs):
        cache = self._kv_cache()
        with attention_context(replace(inp.attn, kv_cache=cache)):
            state = self.head(inp.hidden, inp.next_tokens, inp.positions)  # [R, H]
        if not inp.chain:
            return None, None
        state = state.index_select(0, inp.out_rows)  # [B, H]: the first step's output
        start = inp.positions.index_select(0, inp.out_rows)  # position of each request's last verified row
        metas = chain_metadata(inp.attn, cache, start + 1, self.passes(inp) - 1, inp.slot_limit, inp.max_seq_len,
                               self.group)

        def step(s: int, previous: torch.Tensor | None) -> torch.Tensor:
            nonlocal state
            if s > 0:
                with attention_context(metas[s - 1]):
                    state = self.head(state, previous, start + s)
            return self.head.compute_logits(state)

        return self._chain(inp, step)


class DraftModelProposer(Proposer):
    """A separate causal LM: its KV is filled with the target's own rows, then k single-token steps
    start from the token after each request's last verified row."""

    def __init__(self, model: LlamaForCausalLM, k: int, vocab_size: int, kv_cache_ref):
        super().__init__(k, vocab_size, kv_cache_ref)
        self.model = model
        self.group = attention_group(model)
        self.num_cache_layers = model.cfg.num_layers
        self.needs_hidden = False
        n = min(model.cfg.vocab_size, vocab_size)
        self.width = n
        self.remap = None if n == vocab_size else torch.arange(n, device=model.embed_tokens.weight.device)

    def propose(self, inp: ProposeInputs):
        cache = self._kv_cache()
        top = self.model.cfg.vocab_size - 1  # target ids the draft does not know read as its last id
        with attention_context(replace(inp.attn, kv_cache=cache)):
            self.model(inp.input_ids.clamp(max=top), inp.positions)
        if not inp.chain:
            return None, None
        start = inp.positions.index_select(0, inp.out_rows) + 1  # the verified token after the last row
        first = inp.next_tokens.index_select(0, inp.out_rows)
        metas = chain_metadata(inp.attn, cache, start, self.passes(inp), inp.slot_limit, inp.max_seq_len, self.group)

        def step(s: int, previous: torch.Tensor | None) -> torch.Tensor:
            token = (first if previous is None else previous).clamp(max=top)
            with attention_context(metas[s]):
                hidden, _ = self.model(token, start + s)
            return self.model.compute_logits(hidden)[:, : self.width]

        return self._chain(inp, step)

