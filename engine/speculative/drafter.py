"""Drafter: the draft half of the step. Loads the draft network (or prompt lookup), owns the per-request
draft state (a slot in the draft-distribution buffer), picks each request's next drafts, and keeps a
hand-over's first drafts on the prefill side (`parked`) and gives them back on the decode side (`received`),
where the request's first step verifies them like any other. The step itself is engine/runner/step.py.

A drafter always exists: without speculation it is the k = 0 drafter, which proposes nothing and keeps no
state, so the engine's step has one path for every configuration."""
from __future__ import annotations

import logging
from collections import deque
from typing import Callable

import torch

from engine.config import SpecConfig
from engine.core.request import Request
from engine.handover import HandoverDrafts
from engine.speculative.adaptive import AdaptiveK, Vote
from engine.speculative.deferred_kv import deferrable, make_stash, stash_width
from engine.speculative.loading import DraftTarget, load_proposer
from engine.speculative.ngram import propose_ngram
from engine.speculative.proposer import Proposer
from engine.speculative.tree import DraftTree, TreeShape, TreeSlots
from engine.speculative.tree_score import AcceptanceTable

log = logging.getLogger(__name__)


class Drafter:
    def __init__(self, spec: SpecConfig | None, target: DraftTarget):
        """spec: None for the k = 0 drafter; target: what the draft network is built beside."""
        self.spec = spec
        self.k = spec.k if spec is not None else 0
        self.method = spec.method if spec is not None else None  # what a hand-over names
        self.device = target.device
        self.vocab_size = target.model_cfg.vocab_size
        self._target_cache: torch.Tensor | None = None  # the target's KV cache (allocated after the drafter)
        self.draft_cache: torch.Tensor | None = None  # a cache of its own when the draft's KV shape differs
        self.proposer: Proposer | None = None
        self.draft_kv_shape: tuple[int, int] | None = None  # (kv heads, head dim) of the draft layers
        self.shares_cache = True
        if spec is not None and spec.uses_model:
            self.proposer, self.draft_kv_shape, self.shares_cache = load_proposer(spec, target, self.cache)
        self.num_slots = target.cfg.max_num_seqs
        # Drafts verified per request and step: the chain's k, or a tree's nodes (engine/speculative/tree.py)
        self.num_nodes = spec.num_nodes if spec is not None else 0
        self.tree = spec is not None and spec.tree
        if self.tree:
            self.proposer.tree_shape = TreeShape(spec.topk, spec.k, spec.num_nodes)
            self.proposer.tree_slots = TreeSlots(self.num_slots, spec.num_nodes, self.device)
            if spec.tree_score == "calibrated":
                self.proposer.tree_table = AcceptanceTable(spec.topk, self.device)
        self._free_slots = deque(range(self.num_slots))
        self._slot_of: dict[str, int] = {}
        self.draft_probs: torch.Tensor | None = None  # [slots + 1, k, V] (last row: scratch), on first sampled request
        self.on_slots_grown = None  # callable: buffers captured graphs read were replaced
        self.lookahead_slots = spec.lookahead_slots if spec is not None else 0
        # Drafts proposed on the host from the tokens (prompt lookup): a step planned before the previous
        # one is read cannot draft for its requests.
        self.drafts_on_host = self.k > 0 and self.proposer is None
        # Acceptance-driven k (engine/speculative/adaptive.py). Its cost fit times this engine's own steps where
        # that is the group's measurement (one rank, or ADP ranks, which agree on it); TP ranks use the prior.
        cfg = target.cfg
        self.adaptive = (AdaptiveK(self.k, measured=cfg.tp_size == 1 or cfg.attention_dp > 1)
                         if spec is not None and spec.adaptive_k else None)
        self.draft_passes: int | None = None  # the draft chain's passes this step (None: k)
        # A head's KV over decoding rows waits while no step drafts (adaptive k at 0; engine/speculative/
        # deferred_kv.py): the width of the head's input its stash keeps per KV slot, or 0 where nothing defers.
        self.stash_width = (stash_width(self.proposer, target.model_cfg.hidden_size, self.device)
                            if deferrable(self.proposer, self.tree, cfg.attention_dp > 1,
                                          spec is not None and spec.defer_draft_kv and spec.adaptive_k) else 0)
        self._timed: tuple[int, int] | None = None  # (batch, k) of the step being timed

    def k_for(self, batch: int) -> int:
        """Drafts to verify per request in a decode batch of `batch` requests (dynamic k's bound)."""
        if self.tree:  # a tree's nodes (its size is fixed: no dynamic k)
            return self.num_nodes
        return self.spec.k_for(batch) if self.spec is not None else 0

    def most_accepted(self, num_drafts: int) -> int:
        """The most drafts a step verifying `num_drafts` can accept: all of a chain's, one path of a tree's (at
        most its depth k). What the room of the step after it counts as possibly emitted, synchronous and
        planned ahead alike; counting a tree's N nodes there left a tree step after a rejection without drafts
        whenever max_tokens was within N tokens."""
        return min(num_drafts, self.k) if self.tree else num_drafts

    def room(self, req: Request, pending: int) -> int:
        """The most drafts a request may verify next step, `pending` as draft_room's: the one rule of synchronous
        steps, steps planned ahead (LLMEngine._drafts_ahead) and hand-overs. A tree keeps all its nodes, or near the
        model's length the first ones (in depth order, still a tree) its KV can hold; max_tokens does not cut it,
        since its accepted path is one branch and the host appends no token past max_tokens (cutting a tree of N
        nodes to the tokens still allowed dropped most of its branches over the last N tokens)."""
        room = draft_room(req, pending)
        return kv_room(req, pending) if self.tree and room > 0 else room

    @property
    def dynamic_k(self) -> bool:
        """k may change from step to step (dynamic k, adaptive k)."""
        return self.spec is not None and (bool(self.spec.dynamic_k) or self.adaptive is not None)

    # ------------------------------------------------------------------ the step's k
    def step_k(self, batch: int, running: list[Request], agreed: Vote | None, adp: bool) -> int:
        """This step's k for a group batch of `batch`: dynamic k's bound, and under it adaptive k's choice, from
        the group's vote at the last agreement under ADP (`agreed`; None before the first: the bound), else
        from this engine's own. The draft chain then runs that many passes (eager steps)."""
        k = self.k_for(batch)
        if self.adaptive is None:
            return k
        if adp:
            vote = agreed
        else:
            vote = self.vote([r for r in running if r.num_output_tokens], batch)
        if vote is not None:
            k = self.adaptive.choose(vote, k)
        self.draft_passes = k if self.proposer is not None else None
        self._timed = (batch, k)
        return k

    def vote(self, decoding: list[Request], batch: int) -> Vote | None:
        """This rank's vote on the next k (None without adaptive k)."""
        return self.adaptive.vote(decoding, batch) if self.adaptive is not None else None

    def observe(self, req: Request, num_drafts: int, accepted: int, forced_bits: int) -> None:
        """A decoding step of `req` verified `num_drafts` drafts, accepted `accepted` (bit j of forced_bits:
        draft j was forced by its grammar)."""
        if self.adaptive is not None:
            self.adaptive.acceptance.observe(req.request_id, req.params.structured_output is not None, num_drafts,
                                             accepted, forced_bits)

    def timed(self, scheduled: list, seconds: float) -> None:
        """The step decided by the last step_k, of `scheduled` (ScheduledRequests), took `seconds`; only a step
        of decoding rows alone (no prompt chunk) feeds the cost fit."""
        if self._timed is not None and scheduled and all(s.start >= s.request.num_prompt_tokens for s in scheduled):
            self.adaptive.cost.observe(*self._timed, seconds)
        self._timed = None

    def cache(self) -> torch.Tensor:
        """The cache tensor holding the draft's KV layers."""
        return self._target_cache if self.shares_cache else self.draft_cache

    # ------------------------------------------------------------------ KV layout
    @property
    def num_shared_layers(self) -> int:
        """Layers the draft adds to the target's cache tensor."""
        return self.proposer.num_cache_layers if self.proposer is not None and self.shares_cache else 0

    def attach_caches(self, kv_cache: torch.Tensor, num_blocks: int, block_size: int, dtype: torch.dtype) -> None:
        """kv_cache: the target's, just allocated (the draft's layers extend it when they share its shape)."""
        self._target_cache = kv_cache
        if self.stash_width:
            self.proposer.stash = make_stash(num_blocks * block_size, self.stash_width, dtype, kv_cache.device)
        if self.proposer is not None and not self.shares_cache:
            heads, head_dim = self.draft_kv_shape
            self.draft_cache = torch.zeros((self.proposer.num_cache_layers, 2, num_blocks, block_size, heads, head_dim),
                                           dtype=dtype, device=kv_cache.device)

    def separate_block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes per KV block outside the target's cache tensor: a draft cache of its own, a deferred head's stash."""
        stash = block_size * self.stash_width * dtype.itemsize
        if self.proposer is None or self.shares_cache:
            return stash
        heads, head_dim = self.draft_kv_shape
        return stash + 2 * self.proposer.num_cache_layers * block_size * heads * head_dim * dtype.itemsize

    # ------------------------------------------------------------------ draft state slots
    def slots(self, requests: list[Request]) -> list[int] | None:
        """Each request's row of the draft-state buffers, after making them (None: the k = 0 drafter
        keeps no state)."""
        if not self.k:
            return None
        self.prepare(requests)  # before a graph of a sampled mode is captured
        return [self.slot(r.request_id) for r in requests]

    def slot(self, request_id: str) -> int:
        s = self._slot_of.get(request_id)
        if s is None:
            if not self._free_slots:  # hand-overs joined beyond max_num_seqs
                self._grow_slots()
            s = self._slot_of[request_id] = self._free_slots.popleft()
        return s

    def _grow_slots(self) -> None:
        old = self.num_slots
        self.num_slots *= 2
        self._free_slots.extend(range(old, self.num_slots))
        if self.tree:
            self.proposer.tree_slots.grow(self.num_slots)
        if self.draft_probs is not None:
            grown = self.draft_probs.new_zeros((self.num_slots + 1, *self.draft_probs.shape[1:]))
            grown[:old] = self.draft_probs[:old]
            self.draft_probs = grown
        if self.on_slots_grown is not None:  # captured graphs hold the old buffer and scratch row
            self.on_slots_grown()

    @property
    def num_held(self) -> int:
        """Requests holding a draft-state slot (every one released once its request ends)."""
        return len(self._slot_of)

    def release(self, request_id: str) -> None:
        if self.adaptive is not None:
            self.adaptive.acceptance.forget(request_id)
        s = self._slot_of.pop(request_id, None)
        if s is not None:
            self._free_slots.append(s)

    def prepare(self, requests: list[Request]) -> None:
        """Before a step: the draft-distribution buffer exists once any request samples."""
        if (self.proposer is None or self.tree or self.draft_probs is not None
                or all(r.params.greedy for r in requests)):  # a tree's verification needs no draft distributions
            return
        self.draft_probs = torch.zeros((self.num_slots + 1, self.k, self.vocab_size), dtype=torch.float32,
                                       device=self.device)

    # ------------------------------------------------------------------ drafts
    def next_drafts(self, req: Request, step_drafts: list[int] | None, rejected: int = 0,
                    forced: Callable[[int], list[int]] | None = None, forced_steps: int = 0) -> list[int]:
        """The drafts a request carries into its next step: the draft network's, or prompt lookup's;
        never more than the request may still emit after the next step's own token, counted as if the
        step just read had accepted its `rejected` drafts too. That is the count a step planned before
        the previous one is read must use (engine/runner/overlap.py), so drafts, and with them seeded samples,
        are the same with and without async scheduling; it differs from the exact room only within k
        tokens of max_tokens.
        forced(limit): up to `limit` tokens the request's grammar forces next. A drafter without a draft
        network drafts them first, then looks up after them; a draft network got them through its draft
        masks inside the step (engine/masking/grammar.py), so its drafts already start with them;
        `forced_steps` says which (bit j: draft j). Sets req.spec_forced: which of the drafts are forced."""
        room = min(self.k, draft_room(req, rejected))
        req.spec_forced = 0
        if room <= 0:  # always at k = 0
            return []
        if self.tree:
            drafts = list(step_drafts[: self.room(req, rejected)]) if step_drafts is not None else []
            req.spec_forced = forced_steps & ((1 << len(drafts)) - 1)
            return drafts
        if self.proposer is not None:
            if step_drafts is None:
                return []
            req.spec_forced = forced_steps & ((1 << room) - 1)
            return list(step_drafts[:room])
        lead = forced(room) if forced is not None and self.spec.forced_drafts else []
        req.spec_forced = (1 << min(len(lead), room)) - 1
        if self.spec.method == "grammar" or len(lead) >= room:
            return lead[:room]
        return lead + propose_ngram(req.token_ids + lead, room - len(lead), self.spec.prompt_lookup_min,
                                    self.spec.prompt_lookup_max)

    # ------------------------------------------------------------------ hand-over
    def parked(self, req: Request, step_drafts: list[int] | None,
               forced: Callable[[int], list[int]] | None = None, forced_steps: int = 0) -> HandoverDrafts | None:
        """A prefill-only request's first drafts, from the step that sampled its first token (which drafts for
        prefill-only rows too), with what its verification on the decode side reads: a sampled chain's draft
        distributions, a tree's shape; and which of them the grammar forced (`forced`, `forced_steps` as for
        next_drafts), which the decode side counts in usage. Call before `release`. None at k = 0."""
        if not self.k:
            return None
        tokens = self.next_drafts(req, step_drafts, forced=forced, forced_steps=forced_steps)
        s = self._slot_of.get(req.request_id)
        probs = tree = None
        if tokens and s is not None and self.tree:
            t = self.proposer.tree_slots
            tree = (tuple(t.parents[s].tolist()), tuple(t.depth[s].tolist()), tuple(t.ancestors[s].tolist()))
        elif tokens and s is not None and self.draft_probs is not None and not req.params.greedy:
            probs = self.draft_probs[s, : len(tokens)].clone()
        return HandoverDrafts(tuple(tokens), probs, tree, req.spec_forced)

    def received(self, req: Request, drafts: HandoverDrafts) -> None:
        """A hand-over joined the running batch with its first drafts: its first step verifies them. Drafts its
        verification could not read losslessly (a sampled chain's without their distributions, a tree's without
        its shape) are dropped: the request then starts without drafts. Those the prefill's grammar forced
        (drafts.forced) are the request's forced drafts, as if it had drafted them here."""
        req.spec_token_ids, req.spec_forced = [], 0
        tokens = list(drafts.token_ids[: max(0, min(self.num_nodes, self.room(req, 0)))])  # a tree: N, not its depth
        if not tokens:
            return
        slot = torch.tensor([self.slot(req.request_id)], device=self.device)
        if self.tree:
            if drafts.tree is None or len(drafts.tree[0]) != self.num_nodes:
                return
            parents, depth, ancestors = (torch.tensor([row], dtype=torch.int64, device=self.device)
                                         for row in drafts.tree)
            self.proposer.tree_slots.write(slot, DraftTree(torch.tensor([tokens], device=self.device), parents,
                                                           depth, ancestors))
        elif self.proposer is not None and not req.params.greedy:
            if drafts.probs is None or drafts.probs.shape != (len(drafts.token_ids), self.vocab_size):
                return
            self.prepare([req])
            self.draft_probs[slot, : len(tokens)] = drafts.probs[: len(tokens)].to(self.device, torch.float32)
        req.spec_token_ids, req.spec_forced = tokens, drafts.forced & ((1 << len(tokens)) - 1)


def kv_room(req: Request, pending: int) -> int:
    """Draft rows a request's KV can hold after its next step's own token before it reaches the model's length,
    with `pending` more of its tokens counted as emitted (as draft_room)."""
    return req.max_total_tokens - req.num_tokens - 1 - pending


def draft_room(req: Request, pending: int) -> int:
    """Drafts a request can still use after its next step's own token, with `pending` more of its tokens
    counted as emitted (drafts the step just read rejected, or, planning ahead, all the running step may
    emit): one rule for synchronous and async steps."""
    return min(req.params.max_tokens - req.num_output_tokens, req.max_total_tokens - req.num_tokens) - 1 - pending
