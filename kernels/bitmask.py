"""Grammar token bitmask applied to logits in place, in xgrammar's packed layout.

`bitmask[r, w]` bit j (int32, bit 0 = least significant) set means target token `32 * w + j` is
allowed; a disallowed token's logit becomes -inf. Beyond xgrammar's own kernel this handles what a
speculative decode step needs without a host round trip:
  - `row_has_grammar`: rows whose request has no grammar are left untouched (no data-dependent
    row selection, so the call is CUDA-graph capturable);
  - `indices`: logits row i reads bitmask row `indices[i]` (e.g. the request's grammar slot);
  - `d2t`: logits over a smaller draft vocabulary, masked by a target-vocabulary bitmask, where
    draft id j is target id `j + d2t[j]` (the EAGLE-3 draft-to-target offset table).
Token ids (after d2t) at or past `vocab_size` (default `32 * bitmask.shape[1]`) are left untouched,
as in xgrammar: allocate the bitmask for the model's full padded vocabulary.
The reference adds 0 / -inf rather than writing, so an allowed -0.0 logit may come back as +0.0.
"""
import functools
import sys

import torch
import triton
import triton.language as tl

from kernels import cpu_ext
from kernels._dispatch import use_triton
from kernels._launch import launch

BLOCK_V = 2048  # tokens per program


def _check(logits, bitmask, row_has_grammar, indices, d2t, vocab_size) -> int:
    assert logits.dim() == 2 and bitmask.dim() == 2, (logits.shape, bitmask.shape)
    assert bitmask.dtype == torch.int32, bitmask.dtype
    assert logits.device == bitmask.device
    rows, V = logits.shape
    if indices is None:
        assert bitmask.shape[0] >= rows, (bitmask.shape, logits.shape)
    else:
        assert indices.shape == (rows,) and not indices.is_floating_point(), indices.shape
    if row_has_grammar is not None:
        assert row_has_grammar.shape == (rows,) and row_has_grammar.dtype == torch.bool
    if d2t is not None:
        assert d2t.shape == (V,) and not d2t.is_floating_point(), (d2t.shape, V)
    limit = 32 * bitmask.shape[1]
    return limit if vocab_size is None else min(vocab_size, limit)


@functools.lru_cache(maxsize=16)
def _byte_penalty(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: for each byte value, 0 where bit j is set (allowed) and -inf where it is clear."""
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return torch.where(bits.bool(), 0.0, float("-inf")).to(dtype)


def apply_token_bitmask_ref(
    logits: torch.Tensor,  # [rows, V] float, modified in place
    bitmask: torch.Tensor,  # [bitmask_rows, ceil(Vt / 32)] int32
    row_has_grammar: torch.Tensor | None = None,  # [rows] bool
    indices: torch.Tensor | None = None,  # [rows] int
    d2t: torch.Tensor | None = None,  # [V] int
    vocab_size: int | None = None,
) -> None:
    vt = _check(logits, bitmask, row_has_grammar, indices, d2t, vocab_size)
    rows, V = logits.shape
    if rows == 0:
        return
    words = bitmask[:rows] if indices is None else bitmask.index_select(0, indices.long())  # [rows, W]
    if row_has_grammar is not None:
        words = torch.where(row_has_grammar[:, None], words, -1)  # all bits set: nothing banned
    if d2t is None:
        # Bytes of the little-endian words, in order, are tokens 8i..8i+7: expand each through a
        # 256-entry table of 0 / -inf and add (x + 0 == x, x + -inf == -inf). ~10x faster on CPU
        # than shifting bits and masked_fill.
        assert sys.byteorder == "little"
        n = min(V, vt)
        table = _byte_penalty(logits.dtype, logits.device)
        penalty = table.index_select(0, words.contiguous().view(torch.uint8).view(-1).long()).view(rows, -1)
        logits[:, :n].add_(penalty[:, :n])
        return
    tid = torch.arange(V, device=logits.device) + d2t.long()  # [V] target ids
    in_vocab = (tid >= 0) & (tid < vt)
    tid = torch.where(in_vocab, tid, 0)
    word = words.index_select(1, tid // 32)  # [rows, V]
    banned = (((word >> (tid % 32).to(torch.int32)) & 1) == 0) & in_vocab
    logits.masked_fill_(banned, float("-inf"))


@triton.jit
def _bitmask_kernel(
    logits_ptr,  # [rows, V]
    bitmask_ptr,  # [bitmask_rows, W] int32
    flag_ptr,  # [rows] bool (as int8); read when HAS_FLAG
    indices_ptr,  # [rows] int; read when HAS_INDICES
    d2t_ptr,  # [V] int; read when HAS_D2T
    stride_lr, stride_br, stride_f, stride_i, stride_d,
    V, vocab_size,
    HAS_FLAG: tl.constexpr, HAS_INDICES: tl.constexpr, HAS_D2T: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    if HAS_FLAG:
        # broadcast the row flag to a tensor mask: masked-off rows touch no memory at all
        ok = ok & (tl.load(flag_ptr + row * stride_f + cols * 0, mask=ok, other=0) != 0)
    if HAS_INDICES:
        bm_row = tl.load(indices_ptr + row * stride_i).to(tl.int64)
    else:
        bm_row = row
    if HAS_D2T:
        tid = cols + tl.load(d2t_ptr + cols * stride_d, mask=ok, other=0).to(tl.int32)
        ok = ok & (tid >= 0)
    else:
        tid = cols
    ok = ok & (tid < vocab_size)
    word = tl.load(bitmask_ptr + bm_row * stride_br + tid // 32, mask=ok, other=-1)
    banned = ok & (((word >> (tid % 32)) & 1) == 0)
    tl.store(logits_ptr + row * stride_lr + cols, tl.full([BLOCK], float("-inf"), tl.float32).to(
        logits_ptr.dtype.element_ty), mask=banned)


def _stride(t: torch.Tensor | None) -> int:
    return t.stride(0) if t is not None else 0


def apply_token_bitmask_triton(logits, bitmask, row_has_grammar=None, indices=None, d2t=None,
                               vocab_size=None) -> None:
    vt = _check(logits, bitmask, row_has_grammar, indices, d2t, vocab_size)
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1, (logits.stride(), bitmask.stride())
    rows, V = logits.shape
    if rows == 0 or V == 0:
        return
    dummy = bitmask  # never read when the matching HAS_* flag is off
    flag = row_has_grammar.view(torch.int8) if row_has_grammar is not None else dummy
    launch(
        _bitmask_kernel, (rows, triton.cdiv(V, BLOCK_V)), logits, bitmask, flag,
        indices if indices is not None else dummy,
        d2t if d2t is not None else dummy,
        # the 1-D operands by their strides: a step's flags can be a column slice of [B, k+1] (StepMasks.verify
        # on a trimmed step); read as if contiguous, rows took other requests' flags (found on an H200)
        logits.stride(0), bitmask.stride(0), _stride(row_has_grammar), _stride(indices), _stride(d2t), V, vt,
        HAS_FLAG=row_has_grammar is not None, HAS_INDICES=indices is not None, HAS_D2T=d2t is not None,
        BLOCK=BLOCK_V, num_warps=4,
    )


def apply_token_bitmask_cpu(logits, bitmask, row_has_grammar=None, indices=None, d2t=None,
                            vocab_size=None) -> None:
    """The C++ kernel (kernels/cpu/token_bitmask.cpp; needs cpu_ext.available()): writes -inf where banned."""
    vt = _check(logits, bitmask, row_has_grammar, indices, d2t, vocab_size)
    torch.ops.tandem_cpu.token_bitmask(logits, bitmask, row_has_grammar, indices, d2t, vt)


def apply_token_bitmask(logits, bitmask, row_has_grammar=None, indices=None, d2t=None,
                        vocab_size=None) -> None:
    """Set disallowed logits to -inf in place; see the module docstring for the arguments."""
    if use_triton(logits):
        fn = apply_token_bitmask_triton
    elif logits.device.type == "cpu" and logits.stride(-1) == 1 and cpu_ext.available():
        fn = apply_token_bitmask_cpu
    else:
        fn = apply_token_bitmask_ref
    fn(logits, bitmask, row_has_grammar, indices, d2t, vocab_size)
