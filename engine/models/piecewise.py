"""Piecewise-compiled CPU forwards (EngineConfig.cpu_compile = "layers"), and whole ones ("full").

A decode step on CPU spends most of its time outside the matmuls' arithmetic: ~20 small ops per layer
at a few us each, and MKL reading few-row weights slowly. As in vLLM's piecewise compilation, the
forward is cut at its paged attentions (which read the step's metadata and write the KV cache) and
every piece between two attentions (one layer's output projection, norm and MLP, then the next
layer's norm, QKV projection and rotary embedding) is compiled by engine/layers/cpu_compile.py with its
weights frozen: fused small ops and packed GEMMs. The attentions run eagerly in between, on the
real rows. The zoo target's piece: 93 -> 30 us at 1 row, 180 -> 35 us at 4 (bench/results/
piecewise_cpu.md).

Pieces are compiled per row bucket (1, 4, 8, 16 as packed GEMMs: engine/layers/packed_gemm.py; whole graphs add 2), the
rows of a forward zero-padded up to it (padded rows never reach an attention); forwards with more rows
(prefill chunks, large batches) run eagerly. A bucket compiles on first use or at start-up for the
batch-1 row counts (engine/runner/model_runner.py); each bucket keeps its own packed copy of the weights.
Only where a piece holds no collective: tensor parallelism and attention data parallelism keep the
eager forward (and packed GEMMs).

"full": where the C++ CPU attention serves every attention (kernels/cpu_ext.py), a bucket is one graph from inputs to
outputs with the attentions inside as tandem_cpu.paged_attention_layer, which reads the step that run() sets around
the call (kernels/attention.py, cpu_attention_step): no Python and no piece wrappers between two layers, which cost
~200 us a layer on cold caches in a batch-1 step. Its matmuls are then StreamedGemms (engine/layers/streamed_gemm.py).
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from engine.layers.attention import current_metadata
from engine.layers.cpu_compile import agrees, compile_frozen
from engine.layers.packed_gemm import BUCKETS, PackedGemm
from engine.layers.rotary import RopeAt
from engine.layers.streamed_gemm import NATIVE_ONLY_ROWS, STREAMED_BUCKETS
from engine.models.native_stack import native_mtp, native_target
from kernels.attention import cpu_attention_step, cpu_kernel_serves, paged_attention_layer
from kernels.norm_rope import rope_rows


class PiecewiseForward:
    """A forward of the form  first -> attention -> middle -> attention -> ... -> attention -> last.

    first(*inputs, cos2, sin2) -> (q, k, v, residual); middle(attn, residual, cos2, sin2) -> the same for
    the next attention; last(attn, residual) -> outputs. `inputs` are row-aligned ([T] or [T, ...]); the
    residual each middle returns is the residual stream after the block before it (what draft heads
    capture)."""

    def __init__(self, name: str, first: Callable, middles: list[Callable], last: Callable, attentions: list,
                 cos_sin: torch.Tensor, hidden_size: int, dtype: torch.dtype, full: bool = False):
        assert len(attentions) == len(middles) + 1
        self.name = name
        self.stages = [first, *middles, last]
        self.attentions = attentions
        self.cos_sin = cos_sin
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.full = full  # one graph per bucket where the C++ attention serves (EngineConfig.cpu_compile "full")
        self._fusable: bool | None = None
        # -> the whole forward as one C++ op (engine/models/native_stack.py) or None; asked when a bucket compiles
        self.native: Callable[[], Callable | None] | None = None
        self.native_buckets: set[int] = set()  # the buckets the C++ forward serves
        self._native: Callable | None | bool = False  # self.native()'s answer once asked (False: not yet)
        self._compiled: dict[int, list[Callable] | None] = {}
        self._lock = threading.Lock()
        self.runs = 0  # forwards that ran compiled (tests, logs)

    def run(self, inputs: tuple[torch.Tensor, ...], positions: torch.Tensor):
        """-> (last's outputs cut to the real rows, residuals after each middle's block), or None: no
        compiled pieces for this many rows (run the eager forward)."""
        T = positions.shape[0]
        b = PackedGemm.bucket(T, self.bucket_sizes) if T else None
        if b is None:
            return None
        compiled = self._compiled.get(b, False)
        if compiled is False:
            compiled = self.compile(b, inputs)
        if compiled is None:
            return None
        pad = b - T
        if pad:
            inputs = tuple(F.pad(x, (0, 0) * (x.dim() - 1) + (0, pad)) for x in inputs)
            positions = F.pad(positions, (0, pad))
        else:  # the pieces were traced with dense rows; a tree's frontier states are one row expanded (stride 0)
            inputs = tuple(x.contiguous() for x in inputs)
        cos2, sin2 = rope_rows(positions, self.cos_sin)
        if callable(compiled):  # one graph, its attentions inside
            meta = current_metadata()
            with cpu_attention_step(meta.kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens,
                                    meta.query_start_loc, meta.tree_mask):
                outs = compiled(*inputs, cos2, sin2)
            split = len(outs) - (len(self.stages) - 2)
            self.runs += 1
            return tuple(o[:T] for o in outs[:split]), [r[:T] for r in outs[split:]]
        stages = compiled
        q, k, v, residual = stages[0](*inputs, cos2, sin2)
        residuals = []
        for i, attention in enumerate(self.attentions):
            attn = attention(q[:T], k[:T], v[:T])
            if pad:
                attn = F.pad(attn, (0, 0, 0, pad))
            if i + 1 < len(self.attentions):
                q, k, v, residual = stages[i + 1](attn, residual, cos2, sin2)
                residuals.append(residual[:T])
            else:
                out = stages[-1](attn, residual)
        self.runs += 1
        return tuple(o[:T] for o in out), residuals

    def compile(self, rows: int, like: tuple[torch.Tensor, ...]) -> Callable | list[Callable] | None:
        """The forward for `rows` rows (a bucket): one graph with the attentions inside where the C++ CPU attention
        serves them, else one compiled piece between each two attentions. `like`: inputs of the forward (their
        dtypes and trailing shapes). None where it does not compile."""
        with self._lock:
            if rows in self._compiled:
                return self._compiled[rows]
            gen = torch.Generator().manual_seed(rows)
            inputs = tuple(torch.randint(0, 2, (rows, *x.shape[1:]), dtype=x.dtype) if not x.is_floating_point()
                           else torch.randn((rows, *x.shape[1:]), generator=gen, dtype=x.dtype) for x in like)
            cos2, sin2 = rope_rows(torch.arange(rows), self.cos_sin)
            compiled = self._compile_whole(rows, (*inputs, cos2, sin2)) if self.fusable else None
            if compiled is None and rows <= NATIVE_ONLY_ROWS:
                compiled = self._compile_pieces(rows, (*inputs, cos2, sin2), gen)
            self._compiled[rows] = compiled
            return compiled

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """The row buckets this forward pads to: whole graphs stream one copy of the weights for every bucket and
        add 2 rows (engine/layers/streamed_gemm.py); pieces keep one packed copy per bucket, so fewer."""
        return STREAMED_BUCKETS if self.fusable else BUCKETS

    @property
    def fusable(self) -> bool:
        """Whether one graph holds the attentions: asked to, and the C++ kernel serves them (kernels/attention.py).
        Decided once, when the buckets compile at start-up (asked every step, it cost ~0.25 ms of a 15 ms SmolLM2
        step: a tensor and a dispatch check per attention)."""
        if self._fusable is None:
            self._fusable = self.full and all(
                cpu_kernel_serves(torch.empty(0, a.num_heads, a.head_dim, dtype=self.dtype)) for a in self.attentions)
        return self._fusable

    def _compile_whole(self, rows: int, args: tuple[torch.Tensor, ...]) -> Callable | None:
        """(*inputs, cos2, sin2) -> (*last's outputs, *residuals), traced and checked against a scratch cache
        (one request of `rows` tokens): the compiled function reads whichever step is current when it runs."""
        stages, attentions = self.stages, self.attentions

        def whole(*args):
            q, k, v, residual = stages[0](*args)
            cos2, sin2 = args[-2:]
            residuals = []
            for i, a in enumerate(attentions):
                attn = paged_attention_layer(q, k, v, a.layer_idx, a.scale).view(q.shape[0], -1)
                if i + 1 < len(attentions):
                    q, k, v, residual = stages[i + 1](attn, residual, cos2, sin2)
                    residuals.append(residual)
                else:
                    out = stages[-1](attn, residual)
            return (*out, *residuals)

        a = self.attentions[0]
        size, blocks = 16, -(-rows // 16)
        kv = torch.zeros(max(x.layer_idx for x in attentions) + 1, 2, blocks + 1, size, a.num_kv_heads, a.head_dim,
                         dtype=self.dtype)
        tables = torch.arange(1, blocks + 1, dtype=torch.int32)[None]
        with cpu_attention_step(kv, torch.arange(size, size + rows), tables, torch.tensor([rows], dtype=torch.int32),
                                torch.tensor([0, rows], dtype=torch.int32)):
            if self.native is not None and os.environ.get("TANDEM_NATIVE_STACK", "1") != "0":
                self._native = self.native() if self._native is False else self._native  # built once, for every bucket
            native = self._native or None
            if native is not None:
                with torch.no_grad():
                    want, got = whole(*args), native(*args)  # the attention's cache writes are the same twice
                if agrees(f"{self.name}'s C++ forward ({rows} rows)", got, want, depth=len(attentions)):
                    self.native_buckets.add(rows)
                    return native
            if rows > NATIVE_ONLY_ROWS:  # past the streamed matmuls' rows: the C++ op or the eager forward
                return None
            return compile_frozen(f"{self.name} forward ({rows} rows)", whole, args, depth=len(attentions))

    def _compile_pieces(self, rows: int, args: tuple[torch.Tensor, ...], gen: torch.Generator) -> list[Callable] | None:
        cos2, sin2 = args[-2:]
        compiled = []
        for i, stage in enumerate(self.stages):
            fn = compile_frozen(f"{self.name} piece {i} ({rows} rows)", stage, args)
            if fn is None:
                return None
            compiled.append(fn)
            if i + 1 < len(self.stages):
                q = stage(*args)[0]
                attn = torch.randn(rows, q.shape[1] * q.shape[2], generator=gen, dtype=self.dtype)
                residual = torch.randn(rows, self.hidden_size, generator=gen, dtype=self.dtype)
                args = (attn, residual, cos2, sin2) if i + 2 < len(self.stages) else (attn, residual)
        return compiled

    @property
    def buckets(self) -> dict[int, bool]:
        """bucket -> whether compiled code (pieces or one graph) serves it."""
        return {b: c is not None for b, c in self._compiled.items()}

    @property
    def whole(self) -> set[int]:
        """The buckets one graph serves, attentions inside."""
        return {b for b, c in self._compiled.items() if callable(c)}


def _rope(cos2: torch.Tensor, sin2: torch.Tensor) -> RopeAt:
    return RopeAt(None, (cos2, sin2))  # the reference path reads only the gathered tables


def target_pieces(model, full: bool = False) -> PiecewiseForward:
    """LlamaForCausalLM.forward in pieces: inputs (input_ids,), outputs (final normed hidden, the residual
    stream after the last block)."""
    layers = model.layers

    def first(input_ids, cos2, sin2):
        return layers[0].attention_inputs(_rope(cos2, sin2), model.embed_tokens(input_ids), None)

    def middle(i):
        def piece(attn, residual, cos2, sin2):
            hidden, residual = layers[i].finish(attn, residual)
            return layers[i + 1].attention_inputs(_rope(cos2, sin2), hidden, residual)
        return piece

    def last(attn, residual):
        return model.norm(*layers[-1].finish(attn, residual))

    pieces = PiecewiseForward("target", first, [middle(i) for i in range(len(layers) - 1)], last,
                              [layer.self_attn.attn for layer in layers], model.rotary.cos_sin, model.cfg.hidden_size,
                              model.embed_tokens.weight.dtype, full)
    pieces.native = lambda: native_target(model)
    return pieces


def mtp_pieces(head, full: bool = False) -> PiecewiseForward:
    """MTPHead.forward in pieces: inputs (hidden, token_ids), output (the head's normed state,)."""
    block = head.block

    def first(hidden, token_ids, cos2, sin2):
        x = torch.cat([head.enorm(head.embed_tokens(token_ids)), head.hnorm(hidden)], dim=-1)
        return block.attention_inputs(_rope(cos2, sin2), head.eh_proj(x), None)

    def last(attn, residual):
        out, residual = block.finish(attn, residual)
        return (head.shared_head.norm(out + residual),)

    pieces = PiecewiseForward("mtp head", first, [], last, [block.self_attn.attn], head.rotary.cos_sin,
                              head.cfg.hidden_size, head.eh_proj.weight.dtype, full)
    pieces.native = lambda: native_mtp(head)
    return pieces
