"""CUDA graphs of the decode step: one graph per (padded batch size, sampling mode, masked, draft passes).

Decode-only batches (every request verifying its chain, none prefilling) are laid out with k+1 rows
per request (one without speculation), padded with idle requests to the next captured size (1, 2, 4,
..., max batch) and with block tables of a fixed width (engine/runner/batch.py, `Padding`), so the whole
step has fixed shapes.
At capture the step runs on static input tensors; a replay copies the new batch into them. The
sampling mode (greedy only, filters used, logprobs asked, penalties) picks which branches the step
takes, so it is part of the key, and so is whether a grammar masks the step (its fills are host
functions captured in the graph, engine/masking/graph.py), and so is the draft chain's number of passes (adaptive k:
a step at k below the configured one runs fewer passes, so its graph is another; the verification rows stay k+1);
the unmasked greedy graphs are captured up front at every pass count the drafter may run (k; 0..k under adaptive
k), the others on first use.
Batches with a prompt chunk run eagerly. `capture=False` keeps the same padded path without graphs
(how the CPU tests exercise it).

StepGraphs is handed what it captures and replays, not the model runner: the step function, the KV
cache the batches point into, and the layout numbers (StepLayout) a padded batch is built from.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, replace
from typing import Callable

import torch

from engine.core.block_manager import BlockManager
from engine.core.scheduler import ScheduledRequest
from engine.masking.graph import StagedMasker
from engine.masking.masker import LogitsMasker
from engine.runner.batch import NoBlocks, Padding, StepBatch, build_batch
from engine.runner.staging import in_buffer, rebase
from engine.runner.step import StepOutput
from engine.sample.sampler import SamplingMode
from engine.speculative.tree import TreeShape

log = logging.getLogger(__name__)

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def _tensor_pairs(static, new):
    """(static tensor, new tensor) of every field, in dataclasses recursively; the KV cache is shared."""
    for f in dataclasses.fields(static):
        a, b = getattr(static, f.name), getattr(new, f.name)
        if f.name == "kv_cache":
            assert a is b
        elif isinstance(a, torch.Tensor):
            yield a, b
        elif dataclasses.is_dataclass(a):
            yield from _tensor_pairs(a, b)


def _copy_fields(static, new) -> None:
    """Copy every tensor of `new` into the same field of `static`, one by one (not the packed buffers)."""
    for a, b in _tensor_pairs(static, new):
        if a is not static.staged:
            a.copy_(b)


def _loose(batch, path: tuple[str, ...] = (), staged: torch.Tensor | None = None) -> list[tuple[str, ...]]:
    """The field paths of the batch's tensors that are not views of its packed buffer."""
    staged = batch.staged if staged is None else staged
    paths = []
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor) and f.name != "kv_cache" and v is not staged and not in_buffer(v, staged):
            paths.append((*path, f.name))
        elif dataclasses.is_dataclass(v):
            paths += _loose(v, (*path, f.name), staged)
    return paths


def _field(batch, path: tuple[str, ...]) -> torch.Tensor:
    for name in path:
        batch = getattr(batch, name)
    return batch


@dataclass(frozen=True, slots=True)
class StepLayout:
    """What a padded batch of the step is built from."""

    device: torch.device
    vocab_size: int
    k: int  # drafts per request: k+1 rows per request
    max_seq_len: int  # fixed bound on KV lengths (max_model_len plus the chains' margin)
    tree: TreeShape | None = None  # draft trees' shape: what a guided step's staged tree fills hold (None: chains)


# step(batch, masker) -> outputs: the device step a graph captures (ModelRunner.run_step)
StepFn = Callable[[StepBatch, LogitsMasker | None], StepOutput]


@dataclass
class _Captured:
    inputs: StepBatch  # static tensors the graph reads
    output: StepOutput  # static tensors the graph writes
    graph: object | None  # torch.cuda.CUDAGraph (None: eager replay)
    loose: list[tuple[str, ...]] = dataclasses.field(default_factory=list)  # inputs outside the packed buffer
    runs: int = 0  # steps replayed through it

    def load(self, batch: StepBatch) -> None:
        """Copy a batch into the static inputs: a batch laid out as the captured one (every step of this
        size and sampling mode, in practice) in one copy of its packed buffer plus its loose tensors
        (masks, penalties); any other layout field by field."""
        if batch.staged_layout != self.inputs.staged_layout:
            _copy_fields(self.inputs, batch)
            return
        self.inputs.staged.copy_(batch.staged)
        for path in self.loose:
            _field(self.inputs, path).copy_(_field(batch, path))


class StepGraphs:
    def __init__(self, step: StepFn, layout: StepLayout, max_batch: int, scratch_slot: int, capture: bool = True,
                 capture_on_demand: bool = True, masks: bool = True, passes: tuple[int, ...] | None = None):
        """scratch_slot: the draft-state row idle requests use; capture_on_demand: capture a sampling mode's
        graph the first time a batch needs it (off under attention data parallelism, where a lone
        capture's warm-up forwards would meet no other rank); masks: guided steps replay graphs too (else
        they run eagerly); passes: the draft chain's pass counts whose greedy graphs `capture_all` captures
        (adaptive k: 0..k, so no step captures inside a running server's first minutes; None: k alone).
        Nothing is captured before `capture_all` hands over the KV cache."""
        self.step = step
        self.layout = layout
        self.scratch_slot = scratch_slot
        self.kv_cache: torch.Tensor | None = None
        self.capture = capture
        self.capture_on_demand = capture_on_demand
        self.masks = masks
        self.passes = (layout.k,) if passes is None else tuple(passes)
        self._staged: StagedMasker | None = None
        self.sizes = [s for s in SIZES if s < max_batch] + [max_batch]
        self.block_size: int | None = None
        self._captured: dict[tuple, _Captured] = {}
        self._pool = None
        self.num_runs = 0  # steps that went through the padded (graph) path

    def _padding(self, size: int) -> Padding:
        max_len = self.layout.max_seq_len
        return Padding(batch_size=size, table_width=-(-max_len // self.block_size), scratch_slot=self.scratch_slot,
                       max_seq_len=max_len)

    def fits(self, scheduled: list[ScheduledRequest], masked: bool = False) -> bool:
        """Only decode steps: each request runs its last token plus its drafts, nothing of a prompt."""
        if len(scheduled) > self.sizes[-1] or (masked and not self.masks):
            return False
        return all(s.sample and s.request.num_computed_tokens == s.request.num_tokens - 1 for s in scheduled)

    def size_for(self, num_requests: int) -> int:
        """The captured batch size a batch of `num_requests` pads to."""
        return next(s for s in self.sizes if s >= num_requests)

    def padded_batch(self, scheduled: list[ScheduledRequest], blocks: BlockManager,
                     slots: list[int] | None, size: int | None = None, masked: bool = False,
                     draft_passes: int | None = None) -> StepBatch:
        """size: the captured size to pad to (ADP: the group's, which may exceed this rank's own; an idle
        rank pads an empty batch to it); default the smallest that holds the batch. masked: with room for
        a grammar's bitmasks (a guided step); draft_passes: the draft chain's passes (adaptive k; None: k)."""
        lay = self.layout
        size = size or self.size_for(len(scheduled))
        assert size in self.sizes and size >= len(scheduled), (size, len(scheduled))
        return build_batch(scheduled, blocks, self.kv_cache, lay.device, lay.vocab_size, lay.k, slots,
                           self._padding(size), masked=masked, draft_passes=draft_passes)

    def replay(self, batch: StepBatch, masker: LogitsMasker | None = None) -> StepOutput:
        """Run a padded batch through its size's graph (captured on first use for a new sampling mode).
        masker: the engine's masker of a guided step; the graph's host functions call it."""
        size = batch.verify_rows.shape[0]
        masked = masker is not None
        key = (size, batch.sampling.mode, masked, batch.draft_passes)
        cap = self._captured.get(key)
        if cap is None:
            assert self.capture_on_demand, f"no graph captured for {key}"
            cap = self._capture(key, self.dummy(size, batch.sampling.mode, masked, batch.draft_passes))
        cap.load(batch)
        self.num_runs += 1
        cap.runs += 1
        staged = self.staged if masked else None
        if staged is not None:
            staged.bind(masker)
        try:
            if cap.graph is not None:
                cap.graph.replay()
                return cap.output
            # the padded layout run eagerly: the static metadata's tensors changed in place
            cap.inputs.attn.plans.clear()
            return self.step(cap.inputs, staged)
        finally:
            if staged is not None:
                staged.finish()  # the step's sync, with the GIL released while host functions run

    @property
    def staged(self) -> StagedMasker:
        """The masker guided graphs are captured with (one for every size: host buffers at the largest)."""
        if self._staged is None:
            lay = self.layout
            self._staged = StagedMasker(lay.device, self.sizes[-1], lay.k, lay.vocab_size, lay.tree)
        return self._staged

    @property
    def captured(self) -> dict[tuple, bool]:
        """(padded size, sampling mode, masked, draft passes) of each graph held -> whether it is a CUDA graph
        (False: the padded layout's static buffers, run eagerly, capture=False)."""
        return {key: cap.graph is not None for key, cap in self._captured.items()}

    @property
    def replayed(self) -> dict[tuple, int]:
        """Steps run through each graph so far, by key, those that ran at all."""
        return {key: cap.runs for key, cap in self._captured.items() if cap.runs}

    def captured_at_every_size(self, mode: SamplingMode, masked: bool = False) -> bool:
        """A batch of this sampling mode can replay a graph at whatever size the group pads to."""
        return all((s, mode, masked, self.layout.k) in self._captured for s in self.sizes)

    def reset(self, scratch_slot: int | None = None) -> None:
        """Forget every graph (the buffers they read were replaced; `scratch_slot`: the idle requests' new
        draft-state row); they are captured again on use."""
        self._captured.clear()
        if scratch_slot is not None:
            self.scratch_slot = scratch_slot

    def capture_all(self, kv_cache: torch.Tensor) -> None:
        """Greedy graphs for every size and pass count, largest first (smaller ones then reuse its memory pool),
        over the KV cache every batch points into."""
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        for size in reversed(self.sizes):  # without capture: the static buffers of the padded eager path
            for passes in sorted(self.passes, reverse=True):
                dummy = self.dummy(size, None, draft_passes=passes)
                self._capture((size, dummy.sampling.mode, False, passes), dummy)

    def dummy(self, size: int, like: SamplingMode | None, masked: bool = False,
               draft_passes: int | None = None) -> StepBatch:
        """A batch of idle requests only (it writes no KV and only the scratch draft state) with the
        sampling branches of `like`: what a graph is warmed up and captured on."""
        lay = self.layout
        dummy = build_batch([], NoBlocks(self.block_size), self.kv_cache, lay.device, lay.vocab_size, lay.k, [],
                            self._padding(size), masked=masked, draft_passes=draft_passes)
        if like is None:
            return dummy
        b = dummy.sampling
        flags = dict(all_greedy=like.all_greedy, use_top_k=like.use_top_k, use_top_p=like.use_top_p,
                     use_min_p=like.use_min_p, max_logprobs=like.max_logprobs)
        if like.penalties:
            ones = torch.ones(size, device=lay.device)
            flags.update(repetition=ones, presence=ones * 0, frequency=ones * 0,
                         output_counts=torch.zeros(size, lay.vocab_size, device=lay.device),
                         seen_mask=torch.zeros(size, lay.vocab_size, dtype=torch.bool, device=lay.device))
        if like.logit_bias:
            flags.update(logit_bias=torch.zeros(size, lay.vocab_size, device=lay.device))
        if like.coupled:
            flags.update(coupled=torch.zeros(size, dtype=torch.bool, device=lay.device))
        if like.min_tokens:
            flags.update(early_stop_block=torch.zeros(size, lay.vocab_size, dtype=torch.bool, device=lay.device),
                         min_tokens_left=torch.zeros(size, dtype=torch.int64, device=lay.device))
        return replace(dummy, sampling=replace(b, **flags))

    def _capture(self, key: tuple, batch: StepBatch) -> _Captured:
        inputs = _clone(batch)
        masker = self.staged if key[2] else None  # unbound while capturing: its host functions fill nothing
        if not self.capture:
            cap = _Captured(inputs, None, None, _loose(inputs))
        else:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.inference_mode():
                for _ in range(2):  # warm up: Triton compiles, cuBLAS picks its kernels
                    self.step(inputs, masker)
            torch.cuda.current_stream().wait_stream(stream)
            if masker is not None:
                stream.synchronize()  # the warm-up's host functions ran (releasing the GIL meanwhile)
            graph = torch.cuda.CUDAGraph()
            with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool):
                output = self.step(inputs, masker)
            self._pool = graph.pool()
            cap = _Captured(inputs, output, graph, _loose(inputs))
            log.info("captured the speculative step for batch %d, sampling mode %s, masked %s, %d draft passes", *key)
        self._captured[key] = cap
        return cap


def _clone(batch, staged: tuple[torch.Tensor, torch.Tensor] | None = None):
    """A deep copy of a batch's tensors (the static buffers of a graph), keeping the packed layout: the views
    of the batch's staged buffer become the same views of its copy."""
    if staged is None:
        staged = (batch.staged, batch.staged.clone())
    old, copy = staged
    changes = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor) and f.name != "kv_cache":
            changes[f.name] = copy if v is old else rebase(v, copy) if in_buffer(v, old) else v.clone()
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _clone(v, staged)
    return replace(batch, **changes)
