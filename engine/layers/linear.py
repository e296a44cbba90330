"""Linear layers written for tensor parallelism (Megatron style).

ColumnParallelLinear shards the output dim; RowParallelLinear shards the input dim and all-reduces.
Each parameter knows how to take its slice of a full checkpoint tensor (`load`), so the loader stays
ignorant of parallelism. Fused layers (QKV, gate+up) load several checkpoint tensors into one
parameter, one `shard_id` at a time. The token embedding and the LM head live here too (the head is
a linear; `matvec_layout` lays out both).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.parallel import TPContext, kv_head_slice
from engine.layers import cpu_compile


class _ParallelLinear(nn.Module):
    weight_rows: torch.Tensor | None = None  # a row-major copy of a column-major weight (matvec_layout)
    packed = None  # PackedGemm (engine/layers/packed_gemm.py) when EngineConfig.cpu_compile is on

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext):
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T (+ b); W's rows (outputs) are split across ranks. Output stays sharded."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext):
        self.full_out = out_features
        _, per = tp.shard(out_features, "output features")
        super().__init__(in_features, per, bias, tp)

    def load(self, name: str, tensor: torch.Tensor, shard_id=None) -> None:
        _check_full(tensor, (self.full_out, self.weight.shape[1]), name)
        start, per = self.tp.shard(self.full_out, name)
        param = self.weight if name.endswith("weight") else self.bias
        copy_checked(param, tensor.narrow(0, start, per), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_rows, self.packed)


class RowParallelLinear(_ParallelLinear):
    """y = all_reduce(x_shard W_shard^T) + b; W's columns (inputs) are split across ranks.

    reduce=False leaves the cross-rank sum to the caller (attention data parallelism reduce-scatters
    it, engine/distributed/data_parallel.py): each rank returns its partial product, and rank 0 alone adds the
    bias so that the sum counts it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, reduce: bool = True):
        self.full_in = in_features
        self.reduce = reduce
        _, per = tp.shard(in_features, "input features")
        super().__init__(per, out_features, bias, tp)

    def load(self, name: str, tensor: torch.Tensor, shard_id=None) -> None:
        if name.endswith("bias"):
            copy_checked(self.bias, tensor, name)
            return
        _check_full(tensor, (self.weight.shape[0], self.full_in), name)
        start, per = self.tp.shard(self.full_in, name)
        copy_checked(self.weight, tensor.narrow(1, start, per), name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, rows=self.weight_rows, packed=self.packed)
        if not self.reduce:
            return y + self.bias if self.bias is not None and self.tp.rank == 0 else y
        y = self.tp.all_reduce(y)
        # The bias is added once, after the reduction, not once per rank.
        return y + self.bias if self.bias is not None else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (e.g. gate and up); each part sharded alike."""

    def __init__(self, in_features: int, part_sizes: list[int], bias: bool, tp: TPContext):
        self.part_sizes = list(part_sizes)
        super().__init__(in_features, sum(part_sizes), bias, tp)

    def load(self, name: str, tensor: torch.Tensor, shard_id: int = 0) -> None:
        full = self.part_sizes[shard_id]
        _check_full(tensor, (full, self.weight.shape[1]), name)
        start, per = self.tp.shard(full, name)
        offset = sum(self.tp.shard(s, name)[1] for s in self.part_sizes[:shard_id])
        param = self.weight if name.endswith("weight") else self.bias
        copy_checked(param.narrow(0, offset, per), tensor.narrow(0, start, per), name)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v projections fused; heads are split across ranks (KV heads replicated if fewer)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPContext):
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.local_heads = tp.shard(num_heads, "num_attention_heads")[1]
        # With more ranks than KV heads each rank keeps one (replicated) KV head.
        self.kv_head_start, self.local_kv_heads = kv_head_slice(num_kv_heads, tp.size, tp.rank)
        nn.Module.__init__(self)
        self.tp = tp
        self.part_sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        out = (self.local_heads + 2 * self.local_kv_heads) * head_dim
        self.weight = nn.Parameter(torch.empty(out, hidden), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def load(self, name: str, tensor: torch.Tensor, shard_id: int = 0) -> None:
        d = self.head_dim
        _check_full(tensor, (self.part_sizes[shard_id], self.weight.shape[1]), name)
        q_size, kv_size = self.local_heads * d, self.local_kv_heads * d
        if shard_id == 0:
            start, size, offset = self.tp.rank * q_size, q_size, 0
        else:
            start, size = self.kv_head_start * d, kv_size
            offset = q_size + (shard_id - 1) * kv_size
        param = self.weight if name.endswith("weight") else self.bias
        copy_checked(param.narrow(0, offset, size), tensor.narrow(0, start, size), name)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        d = self.head_dim
        return qkv.split([self.local_heads * d, self.local_kv_heads * d, self.local_kv_heads * d], dim=-1)


def _check_full(tensor: torch.Tensor, expected: tuple[int, int], name: str) -> None:
    """A checkpoint tensor must have the full (unsharded) shape; biases are checked on dim 0 only."""
    from engine.errors import ModelLoadError

    shape = tuple(tensor.shape)
    want = expected[:1] if name.endswith("bias") else expected
    if shape != tuple(want):
        raise ModelLoadError(f"weight {name!r} has shape {shape}, expected {tuple(want)}")


def copy_checked(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    from engine.errors import ModelLoadError

    if tuple(param.shape) != tuple(tensor.shape):
        raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected a slice of "
                             f"shape {tuple(param.shape)}")
    param.data.copy_(tensor)


# Row-major copies of column-major weights, for speculation's few-row steps on CPU (matvec_layout), are kept
# while they fit in this much memory: small models (the zoo target's are 11 MB), where per-step cost matters
# most; a large model on CPU keeps one layout.
VERIFY_ROWS_BUDGET = 256 << 20


# Row counts of x that take W @ x^T on the CPU (see `linear`); bench/tree_ops.py empties it to count a step's
# kernels as a GPU runs it, where F.linear is the one form.
ROW_MAJOR_ROWS = range(2, 9)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           rows: torch.Tensor | None = None, packed=None) -> torch.Tensor:
    """F.linear, except for 2-8 rows of x on CPU (a speculative step's verification rows at batch 1-2)
    against a weight with a row-major form (the weight itself, or `rows`, the copy matvec_layout keeps
    of a column-major one): W @ x^T there, which MKL runs 1.2-1.6x faster than x @ W^T at those sizes
    (cold, one thread, 4 rows: LM head 4096x192 463 -> 311 us, gate/up 1024x192 117 -> 82 us, down
    192x512 52 -> 36 us); from 16 rows on it is no faster, and one row is fastest column-major.
    packed: the weight's PackedGemm or StreamedGemm (it adds `bias` itself), used for the row counts it serves.
    While engine/layers/cpu_compile.py traces a function: the StreamedGemm's op, or F.linear, the form inductor
    packs."""
    if cpu_compile.tracing():
        if packed is not None and packed.in_graphs:
            y = packed(x)
            if y is not None:
                return y
        return F.linear(x, weight, bias)
    if packed is not None:
        y = packed(x)
        if y is not None:
            return y
    if x.shape[0] in ROW_MAJOR_ROWS and x.dim() == 2 and x.device.type == "cpu":
        w = weight if weight.is_contiguous() else rows
        if w is not None:
            y = torch.mm(w, x.t()).t().contiguous()
            return y + bias if bias is not None else y
    return F.linear(x, weight, bias)


# Token embedding and LM head: replicated on every tensor-parallel rank for now (the zoo and small
# models keep the head tiny; a vocab-parallel head, an all-gather of logits, is the next step for 100k+
# vocabularies at tp > 1).
class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden), requires_grad=False)

    def load(self, name: str, tensor: torch.Tensor, shard_id=None) -> None:
        copy_checked(self.weight, tensor, name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(Embedding):
    weight_rows: torch.Tensor | None = None  # a row-major copy of a column-major weight (matvec_layout)
    packed = None  # PackedGemm when EngineConfig.cpu_compile is on

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return linear(hidden, self.weight, rows=self.weight_rows, packed=self.packed)


def matvec_layout(model: nn.Module, rows_budget_bytes: int = 0) -> int:
    """On CPU, keep the [out, in] matmul weights with more outputs than inputs column-major (W^T
    contiguous; the shape and all indexing stay [out, in]). Decode multiplies one row by each weight,
    and MKL reads such a wide weight 2-3x faster from memory at M = 1 when W^T is contiguous (qkv,
    gate/up, the LM head); weights with as many or fewer outputs than inputs (o, down) are read
    faster row-major, as loaded (measured: bench/results/spec_step_cpu.md). Call it after loading:
    the loaders write into [out, in] slices. Idempotent, and a tied weight (embedding = LM head)
    changes once. CUDA weights stay as loaded (cuBLAS and the Triton kernels have their own layouts).

    rows_budget_bytes: speculation verifies 2-8 rows per step at batch 1-2, where a row-major copy is
    faster (`linear`); keep one of every weight made column-major when all of them fit in this budget
    (else none). -> bytes kept."""
    wide = []
    for module in model.modules():
        if not isinstance(module, (_ParallelLinear, Embedding)) or module.weight.device.type != "cpu":
            continue
        w = module.weight
        if w.shape[0] > w.shape[1]:
            if w.is_contiguous():
                w.data = w.data.t().contiguous().t()
            if isinstance(module, (_ParallelLinear, LMHead)):
                wide.append(module)
    kept = sum(m.weight.numel() * m.weight.element_size() for m in wide)
    if not wide or kept > rows_budget_bytes:
        return 0
    for module in wide:
        module.weight_rows = module.weight.data.contiguous()
    return kept
