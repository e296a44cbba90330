"""Owns the model, the KV cache and the drafter of one process and runs one step: build the batch
(prepare) -> launch it (eagerly, or as a captured CUDA graph) -> collect its outputs on the host.
A synchronous step is collect(launch(...)) at once; an overlapped one is collected a call later.

There is one step for every configuration: without speculation it is k = 0 of the speculative step
(the k = 0 drafter, one chain column per request, no draft network), so masking, graphs and the host
update are shared.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, position_margin
from engine.core.block_manager import BlockManager
from engine.core.scheduler import ScheduledRequest
from engine.distributed.data_parallel import DPContext, GroupPlan, RankPlan, dp_rows
from engine.masking.masker import LogitsMasker, MaskRow
from engine.models.llama import LlamaForCausalLM
from engine.runner.batch import StepBatch, build_batch
from engine.runner.overlap import InFlight, carry_inputs
from engine.runner.step import StepOutput, model_step
from engine.sample.sampler import SamplingMode
from engine.speculative import deferred_kv
from engine.speculative.deferred_kv import CatchUp
from engine.speculative.drafter import Drafter
from engine.speculative.loading import DraftTarget
from engine.speculative.proposer import Proposer
from engine.speculative.tree_step import group_outcomes, idle_outcomes, tree_model_step

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepResult:
    """One step's outcome on the host, per scheduled request (rows in scheduling order)."""

    tokens: list[list[int]]  # emitted tokens (accepted drafts then the bonus); [] when not sampling
    num_drafts: list[int]  # drafts verified
    drafts: list[list[int]] | None  # the draft network's next drafts
    logprobs: list[list[float]] | None
    top_ids: list[list[list[int]]] | None
    top_logprobs: list[list[list[float]]] | None
    draft_forced: list[int] | None = None  # draft trees: which of the next drafts the grammar forced (bit j: node j)


@dataclass(frozen=True, slots=True)
class Launched:
    """A step launched by ModelRunner.launch and not read yet."""

    out: StepOutput | None  # on the device: what the next step's carried inputs gather from (None: idle forward)
    host: StepOutput | None  # the same outputs as the host will read them (pinned copies on a GPU; `out` on a CPU)
    ready: object | None  # torch.cuda.Event recorded after the copies (None on a CPU)


@dataclass(frozen=True, slots=True)
class PreparedStep:
    """A step ready to launch (ModelRunner.prepare -> run)."""

    batch: StepBatch | None  # None: an ADP rank's idle forward (others have rows, it has none)
    num_requests: int  # real requests; the batch may be padded past them
    graph: bool  # replay a captured graph (batch is padded to its size)
    masker: LogitsMasker | None  # None: no row of this step is constrained
    dp_rows: int | None = None  # ADP eager step: the group's padded row count around each MLP
    catch_up: CatchUp | None = None  # a deferred head's KV written before the step (engine/speculative/deferred_kv.py)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, target: DraftTarget, drafter: Drafter, max_model_len: int,
                 dp: DPContext | None = None):
        """target: the loaded model (engine/runner/target.py); drafter: the engine's, built beside it (the
        k = 0 drafter without speculation: one step for every configuration); dp: the attention-data-parallel
        group (then every rank steps in lockstep with the group, engine/distributed/data_parallel.py)."""
        self.cfg = cfg
        self.dp = dp
        self.last_plan: GroupPlan | None = None  # ADP: the group's last agreement
        self.model_cfg = target.model_cfg
        self.model = target.model
        self.device = target.device
        self.dtype = target.dtype
        self.vocab_size = self.model_cfg.vocab_size
        self.max_model_len = max_model_len
        # What one layer caches per token, as the model states it (KV heads, or MLA's latent row).
        self.kv_spec = self.model.kv_cache_spec()
        self.num_kv_heads = self.kv_spec.heads
        self.kv_cache: torch.Tensor | None = None
        self.drafter = drafter
        self.k = drafter.num_nodes  # drafts verified per request: a chain's k, a tree's nodes
        self.draft_masks = cfg.speculative is not None and cfg.speculative.draft_masks
        if cfg.weight_dtype is not None:  # before packing: the packed copies are of the rounded weights
            from engine.layers.weight_dtype import round_weights

            round_weights(self._nets(), cfg.torch_weight_dtype())
        if cfg.cpu_compile != "off" and self.device.type == "cpu":
            self._compile_cpu(layers=cfg.cpu_compile in ("layers", "full") and target.tp.size == 1 and dp is None,
                              full=cfg.cpu_compile == "full")
        self.graphs = None
        if self.device.type == "cuda" and cfg.cuda_graphs:
            self.use_graphs(min(cfg.max_graph_batch or cfg.max_num_seqs, cfg.max_num_seqs),
                            capture_on_demand=dp is None, masks=cfg.graph_masks)

    def use_graphs(self, max_batch: int, capture: bool = True, capture_on_demand: bool = True,
                   masks: bool = True) -> None:
        """Run decode steps through StepGraphs (engine/runner/graphs.py): handed the step function, not
        this runner. Captured once the KV cache exists (now, if it does). capture=False: the same padded
        layout run eagerly (how CPU tests exercise it)."""
        from engine.runner.graphs import StepGraphs, StepLayout

        layout = StepLayout(self.device, self.vocab_size, self.k, self.max_model_len + position_margin(self.k),
                            self.proposer.tree_shape if self.drafter.tree else None)
        # adaptive k picks a graph per number of draft passes (ADP steps run all k: model_runner.run)
        passes = (range(self.k + 1) if self.drafter.adaptive is not None and self.drafter.proposer is not None
                  and self.dp is None else None)
        self.graphs = StepGraphs(self.run_step, layout, max_batch, self.scratch_slot, capture=capture,
                                 capture_on_demand=capture_on_demand, masks=masks, passes=passes)
        self.drafter.on_slots_grown = lambda: self.graphs.reset(self.scratch_slot)
        if self.kv_cache is not None:
            self.graphs.capture_all(self.kv_cache)

    def _nets(self) -> list:
        """The target and the draft network beside it (an MTP or EAGLE-3 head, a draft model), if any."""
        proposer = self.proposer
        return [self.model] + [n for n in (getattr(proposer, "head", None), getattr(proposer, "model", None))
                               if n is not None]

    def _compile_cpu(self, layers: bool, full: bool = False) -> None:
        """EngineConfig.cpu_compile: piecewise-compiled layers for the target and its draft network (`layers`:
        only without collectives inside a piece, i.e. tp_size 1 and no ADP; `full`: each row bucket's forward one
        graph where the C++ CPU attention serves it, every matmul of it and the LM head streamed by the C++ kernel),
        packed GEMMs for the matmuls no piece holds (LM heads; everything without `layers`). Every row bucket
        compiles now, at start-up, as vLLM captures every graph size: compiled on first use, a bucket stalled the
        engine mid-request (SmolLM2 on "full": ~85 s of compiles when prefix-cache hits first prefilled 4-16-token
        tails, every running request waiting; bench/results/real_spec_full_warm_cpu.md)."""
        from engine.layers.packed_gemm import BUCKETS, PackedGemm, pack_cpu_gemms, warm_up
        from engine.layers.streamed_gemm import stream_cpu_gemms
        from engine.models.mtp import MTPHead
        from engine.models.piecewise import mtp_pieces, target_pieces
        from kernels._dispatch import use_triton

        layers = layers and not use_triton(torch.empty(0))  # pieces trace the torch references
        nets = self._nets()
        rows = BUCKETS
        start = time.perf_counter()
        streamed = {}  # weight -> its StreamedGemm, across the nets (a draft head may share the target's LM head)
        for net in nets:
            pieces = None
            if layers and isinstance(net, LlamaForCausalLM) and net.cfg.moe is None:  # MoE blocks: GEMMs only
                pieces = net.piecewise = target_pieces(net, full)
            elif layers and isinstance(net, MTPHead):
                pieces = net.piecewise = mtp_pieces(net, full)
            if pieces is not None and pieces.fusable:  # every matmul streams one packed copy, the LM head's too
                stream_cpu_gemms(net, streamed, self.cfg.torch_weight_dtype())
            elif pieces is not None:  # the LM head is the one matmul outside the pieces
                head = net.lm_head if isinstance(net, LlamaForCausalLM) else net.shared_head.head
                pack_cpu_gemms(head)
                warm_up(head, rows)
            if pieces is not None:
                like = (torch.zeros(1, dtype=torch.int64),) if isinstance(net, LlamaForCausalLM) else (
                    torch.zeros(1, net.cfg.hidden_size, dtype=self.dtype), torch.zeros(1, dtype=torch.int64))
                for b in PackedGemm.usable(pieces.bucket_sizes):
                    pieces.compile(b, like)
            else:
                pack_cpu_gemms(net)
                warm_up(net, rows)
        mode = ("full" if full else "layers") if layers else "gemm"
        log.info("CPU compilation (%s) done in %.1f s", mode, time.perf_counter() - start)

    # ------------------------------------------------------------------ KV layout
    @property
    def num_cache_layers(self) -> int:
        """Layers of the cache tensor: the target's, then the draft's when they share its shape."""
        return self.model_cfg.num_layers + self.drafter.num_shared_layers

    def kv_block_bytes(self) -> int:
        per = self.num_cache_layers * self.cfg.block_size * self.kv_spec.bytes_per_token(self.dtype)
        return per + self.drafter.separate_block_bytes(self.cfg.block_size, self.dtype)

    def auto_num_blocks(self, max_model_len: int) -> int:
        """KV blocks that fit the budget (gpu_memory_utilization of the free device memory; kv_cache_memory_gb
        on a CPU), and no more than max_num_seqs requests of max_model_len tokens hold."""
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * self.cfg.gpu_memory_utilization)
        else:
            budget = int(self.cfg.kv_cache_memory_gb * 2**30)
        wanted = self.cfg.max_num_seqs * -(-max_model_len // self.cfg.block_size)
        return max(1, min(budget // self.kv_block_bytes() - self.scratch_blocks, wanted))

    @property
    def scratch_blocks(self) -> int:
        """Blocks the cache holds past the pool's: with draft trees one, where a padded step's padding rows move KV
        (kernels/tree_accept.py's reference; its kernel skips them), so that they touch no block a request holds,
        not even one a hand-over is being written into meanwhile; none for chains, whose padding rows write nothing."""
        return 1 if self.drafter.tree else 0

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """The cache of the pool's `num_blocks` blocks and the scratch blocks past them, which no request holds."""
        shape = self.kv_spec.shape(self.num_cache_layers, num_blocks + self.scratch_blocks, self.cfg.block_size)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.drafter.attach_caches(self.kv_cache, num_blocks, self.cfg.block_size, self.dtype)
        if self.graphs is not None:
            self.graphs.capture_all(self.kv_cache)
        return self.kv_cache

    # ------------------------------------------------------------------ what the step and its graphs read
    @property
    def proposer(self) -> Proposer | None:
        return self.drafter.proposer

    @property
    def draft_probs(self) -> torch.Tensor | None:
        return self.drafter.draft_probs

    @property
    def scratch_slot(self) -> int:
        """Draft-state row that padding requests of a graph use."""
        return self.drafter.num_slots if self.drafter.k else 0

    def run_step(self, batch: StepBatch, masker: LogitsMasker | None = None, rows: int | None = None) -> StepOutput:
        """rows: under ADP, the group's padded row count of an eager step; None: a graph's step (captured or its
        padded layout), whose padded batch every rank shares, rows and requests alike."""
        scope = dp_rows(rows or batch.input_ids.shape[0]) if self.dp is not None else contextlib.nullcontext()
        with scope:
            if self.drafter.tree:  # draft trees have a step of their own
                share = self._share(batch.verify_rows.shape[0] if rows is None else None)
                return tree_model_step(self.model, self.proposer, batch, masker, self.draft_masks, share)
            return model_step(self.model, self.proposer, batch, self.draft_probs, masker, self.draft_masks)

    # ------------------------------------------------------------------ the step
    def prepare(self, scheduled: list[ScheduledRequest], blocks: BlockManager, masker: LogitsMasker | None = None,
                carry_from: InFlight | None = None) -> PreparedStep | None:
        """Host work before launch: draft-state slots, the masker's snapshot, the batch's tensors
        (padded to a captured size when a graph will replay it). Under ADP every rank calls it every
        step, with or without requests (it holds the group's agreement); None: no rank runs a forward.
        masker: the engine's (it masks the step when some row of it is constrained).
        carry_from: the step still running when this one was planned (engine/runner/overlap.py): the carried
        requests' inputs are gathered from its outputs on the device (never under ADP or with masks)."""
        slots = self.drafter.slots([s.request for s in scheduled])
        masker = _begin_masks(masker, scheduled) if masker is not None and scheduled else None
        masked = masker is not None
        # A guided step replays a graph too: its grammar fills are host functions captured in it.
        graph = self.graphs is not None and self.graphs.fits(scheduled, masked)
        graph_batch, rows = None, None
        if self.dp is not None:  # the group agrees on counts and sampling modes first: the batch is built once
            if graph and scheduled:
                # Under ADP a graph is never captured on demand (its warm-up forwards would run collectives
                # no other rank joins): replay only sampling modes captured up front at every size.
                mode = SamplingMode.of([s.request for s in scheduled], self.vocab_size)
                graph = self.graphs.captured_at_every_size(mode, masked)
            plan = self.last_plan = self._agree(scheduled, graph)
            if not plan.forward:
                return None
            graph, graph_batch, rows = plan.graph, plan.graph_batch or None, plan.max_tokens
            if not scheduled and not graph:
                return PreparedStep(None, 0, False, None, rows)
        if graph:
            # adaptive k's passes pick the graph (greedy ones captured up front); under ADP graphs are never captured on
            # demand, so the group's steps keep all k passes there
            passes = self.drafter.draft_passes if self.dp is None else None
            batch = self.graphs.padded_batch(scheduled, blocks, slots, graph_batch, masked=masked, draft_passes=passes)
        else:
            # One rank alone verifies only the columns that hold drafts: TP and ADP ranks keep k+1, as their LM
            # heads' collectives need the same shapes on every rank.
            trim = self.dp is None and self.cfg.tp_size == 1
            batch = build_batch(scheduled, blocks, self.kv_cache, self.device, self.vocab_size, self.k, slots,
                                masked=masker is not None, draft_passes=self.drafter.draft_passes, trim=trim)
        if carry_from is not None:
            assert masker is None and self.dp is None, "a carried step has no masks and no ADP agreement"
            carry_inputs(batch, scheduled, carry_from, self.k, padded=graph)
        catch = None
        if self.proposer is not None and self.proposer.stash is not None:
            counts = [self.k + 1 if graph else s.num_new_tokens for s in scheduled]
            fill, catch = deferred_kv.plan(scheduled, batch.attn, counts, batch.draft_passes > 0,
                                           blocks, self.device)
            batch = dataclasses.replace(batch, draft_fill=fill)
        return PreparedStep(batch, len(scheduled), graph, masker, None if graph else rows, catch)

    def _share(self, padded: int | None = None):
        """ADP with draft trees: how a step's verification outcomes reach every rank (tree_step.group_outcomes).
        padded: a graph's batch size, what every rank gathers then (a graph captured with the agreement's count
        would replay it whatever later steps agree); None: an eager step's agreed count."""
        if self.dp is None:
            return None
        return functools.partial(group_outcomes, self.dp, padded or max(self.last_plan.requests))

    def _agree(self, scheduled: list[ScheduledRequest], can_graph: bool) -> GroupPlan:
        """ADP: one all-gather of what each rank would run; every rank gets the same GroupPlan."""
        tokens = sum(s.num_new_tokens for s in scheduled)
        size = self.graphs.size_for(len(scheduled)) if can_graph and scheduled else 0
        batch = self.last_plan.total_requests if self.last_plan is not None else len(scheduled)
        vote = self.drafter.vote([s.request for s in scheduled if s.request.num_output_tokens], batch)
        return self.dp.agree(RankPlan(tokens, len(scheduled), can_graph and bool(scheduled), size, vote))

    def run(self, step: PreparedStep) -> StepResult | None:
        """A step launched and read at once (None for an idle forward: nothing of this rank's ran)."""
        return self.collect(step, self.launch(step))

    @torch.inference_mode()
    def launch(self, step: PreparedStep) -> Launched:
        """Start a step without reading it (on a GPU the kernels are queued and this returns at once);
        `collect` reads it. On a GPU its small outputs are also queued for copying into pinned host
        memory behind it, with an event: reading them later waits for this step only, not for a step
        launched after it (a plain .tolist() would wait for the whole stream). A graph's static outputs
        are copied, since the next replay, launched before they are read, overwrites them."""
        if step.batch is None:  # an ADP rank's idle forward: it joins the group's collectives
            with dp_rows(step.dp_rows):
                self.model.idle_forward(self.dtype, self.device)
            if self.drafter.tree:  # its acceptance table learns the group's verifications too
                idle_outcomes(self.proposer, self._share())
            return Launched(None, None, None)
        try:
            out = self._forward(step)
        except BaseException:
            if step.masker is not None:
                step.masker.end_step()
            raise
        if step.graph:
            out = StepOutput(**{f.name: _cloned(getattr(out, f.name)) for f in dataclasses.fields(out)})
        if out.tokens.device.type != "cuda":
            return Launched(out, out, None)
        host = StepOutput(**{f.name: _pinned_copy(getattr(out, f.name)) for f in dataclasses.fields(out)})
        ready = torch.cuda.Event()
        ready.record()
        return Launched(out, host, ready)

    def collect(self, step: PreparedStep, launched: Launched) -> StepResult | None:
        """The launched step's outputs on the host: its one sync (None for an idle forward)."""
        if launched.out is None:
            return None
        try:
            if launched.ready is not None:
                launched.ready.synchronize()
            return _to_host(launched.host, step.num_requests, step.batch.host_num_drafts, step.batch.host_samples)
        finally:
            if step.masker is not None:
                step.masker.end_step()

    def _forward(self, step: PreparedStep) -> StepOutput:
        if step.catch_up is not None:  # eager, before a graph's replay too (its rows vary from step to step)
            deferred_kv.catch_up(self.proposer, step.catch_up, step.batch.input_ids, step.batch.sampling)
        return (self.graphs.replay(step.batch, step.masker) if step.graph
                else self.run_step(step.batch, step.masker, step.dp_rows))

def _begin_masks(masker: LogitsMasker, scheduled: list[ScheduledRequest]) -> LogitsMasker | None:
    """The masker when some request of this step is constrained; its host snapshot is taken here."""
    rows = []
    for s in scheduled:
        req = s.request
        num_drafts = req.num_computed_tokens + s.num_new_tokens - req.num_tokens if s.sample else 0
        rows.append(MaskRow(req.request_id, tuple(req.spec_token_ids[:num_drafts]), s.sample))
    return masker if masker.begin_step(tuple(rows)) else None


def _to_host(out: StepOutput, B: int, num_drafts: list[int], samples: list[bool]) -> StepResult:
    # The one host sync of a step, after everything ran.
    tokens = out.tokens[:B].tolist()
    accepted = out.num_accepted[:B].tolist()
    emitted = [row[: a + 1] if s else [] for row, a, s in zip(tokens, accepted, samples)]
    drafts = out.drafts[:B].tolist() if out.drafts is not None else None
    lps = out.logprobs[:B].tolist() if out.logprobs is not None else None
    top_ids = out.top_ids[:B].tolist() if out.top_ids is not None else None
    top_lps = out.top_logprobs[:B].tolist() if out.top_logprobs is not None else None
    forced = out.forced[:B].tolist() if out.forced is not None else None
    return StepResult(emitted, num_drafts, drafts, lps, top_ids, top_lps, forced)


def _cloned(value):
    return value.clone() if isinstance(value, torch.Tensor) else value


def _pinned_copy(value):
    """A non-blocking copy of a device tensor into pinned host memory (queued on the current stream)."""
    if not isinstance(value, torch.Tensor):
        return value
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    return host
