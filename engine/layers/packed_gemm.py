"""Prepacked CPU GEMMs for decode's few-row matmuls (EngineConfig.cpu_compile = "gemm", and the LM heads under "layers").

At 1-16 rows a decode step's matmuls are bound by reading the weights, and MKL reads them slowly
there: one row against a weight in DRAM ran at 22-29 GB/s on the 2-core EPYC this was built on
(one thread; 42 GB/s read + write copy bandwidth), and four rows (a batch-1 verification chain) cost
2-3x one row. Inductor's CPU GEMM template, given the weight as a constant (`freezing`), repacks it
once into blocks its micro-kernel streams: 40-56 GB/s at one row (1.4-1.9x MKL), four rows at
1.1-1.3x the cost of one (2.3-3.2x MKL), eight 1.0-1.6x MKL; with two threads it splits the
weight between them and gains 1.1-3.9x / 3.2-6x / 1.7-2.9x / 1.2-1.8x at 1 / 4 / 8 / 16 rows, where
MKL's one-row matmul gains nothing from a second thread (bench/results/packed_gemm_cpu.md,
packed_gemm_2threads_cpu.md).

Each weight gets one compiled kernel per row bucket (1, 4, 8, and 16 with more than one thread: on one
thread 16 rows are compute-bound and MKL is as fast), compiled on first use or by `warm_up`; a bucket
holds its own packed copy of the weight, so a model pays one extra copy of its weights per bucket it
uses (two at batch 1 with speculation: 1 row in the draft chain, k+1 rows to verify). Rows between
buckets are zero-padded to the next one: the kernels are bound by reading the weight, so padded rows
cost little, and fewer buckets keep fewer copies. Compiled by engine/layers/cpu_compile.py: a kernel that fails to compile or disagrees
with F.linear on a probe is never used, and the matmul stays eager, as on a machine without a C++
compiler.
"""
from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.cpu_compile import compile_frozen

BUCKETS = (1, 4, 8, 16)


class PackedGemm:
    """y = x W^T + b through a compiled kernel per row bucket; None where none applies."""

    in_graphs = False  # compiled code itself: a traced function reads F.linear instead (engine/layers/linear.py)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, name: str = ""):
        self.weight = weight
        self.bias = bias
        self.name = name
        self._kernels: dict[int, object | None] = {}  # bucket -> compiled callable (None: stay eager)
        self._lock = threading.Lock()

    @staticmethod
    def usable(buckets: tuple[int, ...] = BUCKETS) -> tuple[int, ...]:
        """The buckets compiled code serves: all with more than one thread, the largest (16 rows) left out on one."""
        return buckets if torch.get_num_threads() > 1 else buckets[:-1]

    @staticmethod
    def bucket(rows: int, buckets: tuple[int, ...] = BUCKETS) -> int | None:
        """The bucket `rows` rows pad to, or None (past the largest usable one)."""
        return next((b for b in PackedGemm.usable(buckets) if rows <= b), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """x [rows, in] -> [rows, out], or None: too many rows, or no kernel for them (use F.linear)."""
        rows = x.shape[0]
        b = self.bucket(rows) if rows else None
        if b is None or x.dim() != 2 or x.dtype != self.weight.dtype:
            return None
        kernel = self._kernels.get(b, False)
        if kernel is False:
            kernel = self.compile(b)
        if kernel is None:
            return None
        if rows == b:
            return kernel(x.contiguous())
        return kernel(torch.cat([x, x.new_zeros(b - rows, x.shape[1])]))[:rows]

    def compile(self, rows: int):
        """The kernel for `rows` rows (a bucket), compiled now if it was not; None: stay eager."""
        with self._lock:
            if rows not in self._kernels:
                probe = torch.randn(rows, self.weight.shape[1], generator=torch.Generator().manual_seed(rows),
                                    dtype=self.weight.dtype)
                w, b = self.weight, self.bias
                self._kernels[rows] = compile_frozen(f"GEMM {self.name} ({rows} rows)",
                                                     lambda x: F.linear(x, w, b), (probe,))
            return self._kernels[rows]

    @property
    def kernels(self) -> dict[int, bool]:
        """bucket -> whether a compiled kernel serves it (for tests and logs)."""
        return {b: k is not None for b, k in self._kernels.items()}


def cpu_linears(model: nn.Module):
    """(name, module, bias) for every CPU linear of `model` (projections and the LM head), `bias` being what its
    packed form adds: a row-parallel layer adds its own after the cross-rank sum (or on rank 0 alone)."""
    from engine.layers.linear import LMHead, RowParallelLinear, _ParallelLinear

    for name, module in model.named_modules():
        if isinstance(module, (_ParallelLinear, LMHead)) and module.weight.device.type == "cpu":
            yield name, module, None if isinstance(module, RowParallelLinear) else getattr(module, "bias", None)


def pack_cpu_gemms(model: nn.Module) -> int:
    """Give every CPU linear of `model` (projections and the LM head) a PackedGemm; its kernels compile
    on first use (or `warm_up`). Idempotent; a weight shared by two modules (a tied or shared head)
    gets one. -> number of weights packed."""
    seen: dict[int, PackedGemm] = {}
    for name, module, bias in cpu_linears(model):
        if getattr(module, "packed", None) is not None:
            seen.setdefault(id(module.weight), module.packed)
            continue
        key = id(module.weight)
        if key not in seen:
            seen[key] = PackedGemm(module.weight, bias, name)
        module.packed = seen[key]
    return len(seen)


def warm_up(model: nn.Module, rows: tuple[int, ...]) -> None:
    """Compile every packed weight's kernels for these row counts now (start-up, not the first steps)."""
    buckets = sorted({b for r in rows if (b := PackedGemm.bucket(r)) is not None})
    done: set[int] = set()
    for module in model.modules():
        packed = getattr(module, "packed", None)
        # a StreamedGemm (a weight shared with a net compiled "full", e.g. an EAGLE-3 head's LM head) needs no compile
        if packed is None or packed.in_graphs or id(packed) in done:
            continue
        done.add(id(packed))
        for b in buckets:
            packed.compile(b)
