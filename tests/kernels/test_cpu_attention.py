"""kernels/cpu/paged_attention.cpp (torch.ops.tandem_cpu.paged_attention, built by kernels/cpu_ext.py): the C++ CPU
attention against dense per-request math and the torch reference, with its fused K/V stores, tree masks, skipped long
requests, NaN in unwritten slots, and its errors. The engine runs it for every short request on a CPU, so the engine
tests (greedy equal to transformers, speculation equal to no speculation) run through it too."""
import math
import os
import subprocess
import sys

import pytest
import torch

from kernels import cpu_ext
from kernels.attention import CPU_KERNEL_HEAD_DIMS, paged_attention_cpu, paged_attention_ref
from kernels.store_kv import store_kv_ref

from tests.kernels.test_attention import CASES, HEADS, expected
from tests.kernels.test_tree_mask import dense_masked
from tests.support.paged_batches import TOL, TREE_CASES, tree_case
from tests.support.paged_batches import paged_batch as make_batch

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=f"C++ CPU kernels off: {cpu_ext.why_off()}")


def _cpu(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_q_len=None, max_seq_len=None,
         **kw):
    return paged_attention_cpu(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, **kw)


@pytest.mark.parametrize("q_lens,seq_lens", CASES)
@pytest.mark.parametrize("Hq,Hkv", HEADS)
def test_equals_dense_math(q_lens, seq_lens, Hq, Hkv):
    batch, dk, dv = make_batch(q_lens, seq_lens, Hq, Hkv, 64, 16, torch.float32, pad_rows=2)
    out = _cpu(**batch, scale=0.125)
    n = sum(q_lens)
    torch.testing.assert_close(out[:n].double(), expected(batch, dk, dv, q_lens, seq_lens, 0.125)[:n],
                               atol=2e-5, rtol=2e-5)
    assert torch.all(out[n:] == 0), "rows past the batch are zero"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", CPU_KERNEL_HEAD_DIMS)
def test_dtypes_and_head_dims(dtype, D):
    """Every head dim built (the Python list mirrors the C++ switch), in each cache dtype, against the reference."""
    q_lens, seq_lens = [1, 4, 0, 2], [37, 20, 0, 9]
    batch, dk, dv = make_batch(q_lens, seq_lens, 6, 2, D, 8, dtype, pad_rows=1)
    out = _cpu(**batch, scale=1 / math.sqrt(D))
    n = sum(q_lens)
    torch.testing.assert_close(out[:n].double(), expected(batch, dk, dv, q_lens, seq_lens, 1 / math.sqrt(D))[:n],
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("q_lens,seq_lens", TREE_CASES)
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2)])
def test_tree_masks(q_lens, seq_lens, Hq, Hkv):
    batch, dk, dv = make_batch(q_lens, seq_lens, Hq, Hkv, 32, 8, torch.float32)
    tree, allowed = tree_case(q_lens, seq_lens, 0)
    out = _cpu(**batch, scale=1 / math.sqrt(32), tree_mask=tree)
    start = 0
    for b, n in enumerate(q_lens):
        if n:
            want = dense_masked(batch["query"][start : start + n], dk[b], dv[b], allowed[b], 1 / math.sqrt(32))
            torch.testing.assert_close(out[start : start + n].double(), want, atol=2e-5, rtol=2e-5)
        start += n


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("q_lens,seq_lens", [([4], [700]), ([5], [900]), ([1], [2000]), ([3, 2], [600, 800])])
def test_work_split_by_kv_head_and_rows(q_lens, seq_lens, tree):
    """Long few-request steps on 2 threads run as (request, KV head) items, split by new rows where 3 KV heads would
    leave a thread idle: every row and head still equals dense math, with a tree mask too, and 4-vector weighted sums
    (G = 3 query heads, 4-5 rows) over positions whose unwritten slots hold NaN."""
    batch, dk, dv = make_batch(q_lens, seq_lens, 9, 3, 64, 16, torch.float32, pad_rows=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        if tree:
            mask, allowed = tree_case(q_lens, seq_lens, 3)
            out = _cpu(**batch, scale=0.125, tree_mask=torch.cat([mask, mask.new_zeros(1)]))  # and the pad row's
        else:
            out = _cpu(**batch, scale=0.125)
    finally:
        torch.set_num_threads(threads)
    n = sum(q_lens)
    if tree:
        start = 0
        for b, rows in enumerate(q_lens):
            want = dense_masked(batch["query"][start : start + rows], dk[b], dv[b], allowed[b], 0.125)
            torch.testing.assert_close(out[start : start + rows].double(), want, atol=2e-5, rtol=2e-5)
            start += rows
    else:
        torch.testing.assert_close(out[:n].double(), expected(batch, dk, dv, q_lens, seq_lens, 0.125)[:n],
                                   atol=2e-5, rtol=2e-5)
    assert torch.all(out[n:] == 0)


@pytest.mark.parametrize("T,pad", [(1, 0), (3, 1), (6, 6)])
def test_fused_store_equals_store_kv(T, pad):
    """The stores the call makes before attending are store_kv's: rows with slot -1 write nothing, and the
    attention reads the new rows (each request's last position is its new row)."""
    gen = torch.Generator().manual_seed(T + pad)
    seq = [5 + 3 * t for t in range(T)]
    batch, _, _ = make_batch([1] * T, seq, 6, 2, 64, 4, torch.float32)
    key = torch.randn(T, 2, 64, generator=gen)
    value = torch.randn(T, 2, 64, generator=gen)
    tables = batch["block_tables"].long()
    slots = torch.stack([tables[t, (s - 1) // 4] * 4 + (s - 1) % 4 for t, s in enumerate(seq)])
    slots[torch.randperm(T, generator=gen)[:pad]] = -1
    kc, vc = batch["k_cache"].clone(), batch["v_cache"].clone()
    store_kv_ref(key, value, kc, vc, slots)
    want = paged_attention_ref(batch["query"], kc, vc, batch["block_tables"], batch["seq_lens"],
                               batch["query_start_loc"], 0.125, 1, max(seq))
    got_batch = dict(batch, k_cache=batch["k_cache"].clone(), v_cache=batch["v_cache"].clone())
    out = _cpu(**got_batch, scale=0.125, key=key, value=value, slot_mapping=slots)
    assert torch.equal(got_batch["k_cache"].nan_to_num(7.0), kc.nan_to_num(7.0))
    assert torch.equal(got_batch["v_cache"].nan_to_num(7.0), vc.nan_to_num(7.0))
    written = (slots >= 0).nonzero().flatten()  # rows whose new K/V are NaN slots otherwise
    torch.testing.assert_close(out[written], want[written], atol=2e-5, rtol=2e-5)


def test_max_rows_leaves_long_requests_to_the_caller():
    q_lens, seq_lens = [1, 20, 3], [30, 40, 9]
    batch, dk, dv = make_batch(q_lens, seq_lens, 6, 2, 64, 16, torch.float32)
    out = torch.full_like(batch["query"], 7.0)
    _cpu(**batch, scale=0.125, out=out, max_rows=16)
    want = expected(batch, dk, dv, q_lens, seq_lens, 0.125)
    torch.testing.assert_close(out[:1].double(), want[:1], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out[21:24].double(), want[21:24], atol=2e-5, rtol=2e-5)
    assert torch.all(out[1:21] == 7.0)


def test_strided_query_and_output():
    """q as a view into a fused QKV projection's rows (the engine's layout)."""
    batch, dk, dv = make_batch([2, 1], [10, 33], 6, 2, 64, 16, torch.float32)
    fused = torch.randn(3, 6 + 4, 64)
    fused[:, :6] = batch["query"]
    out = _cpu(**dict(batch, query=fused[:, :6]), scale=0.125)
    torch.testing.assert_close(out.double(), expected(batch, dk, dv, [2, 1], [10, 33], 0.125), atol=2e-5, rtol=2e-5)


def test_bad_inputs_raise_naming_the_argument():
    batch, _, _ = make_batch([1], [5], 6, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="block_tables int32"):
        _cpu(**dict(batch, block_tables=batch["block_tables"].long()), scale=0.125)
    with pytest.raises(RuntimeError, match="head dim 24"):
        b24, _, _ = make_batch([1], [5], 6, 2, 24, 16, torch.float32)
        _cpu(**b24, scale=0.125)
    with pytest.raises(RuntimeError, match="is not a block of the cache"):
        _cpu(**dict(batch, block_tables=batch["block_tables"] + 1000), scale=0.125)
    with pytest.raises(RuntimeError, match="past the cache"):
        key = torch.randn(1, 2, 64)
        _cpu(**batch, scale=0.125, key=key, value=key, slot_mapping=torch.tensor([10**6]))


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_off_switch_and_failed_build_fall_back(tmp_path):
    """TANDEM_CPU_KERNELS=0, or a build that fails (no compiler), leave the kernels off with the reason, and the
    engine's attention on the reference."""
    code = ("from kernels import cpu_ext; import torch\n"
            "from kernels.attention import cpu_kernel_serves\n"
            "print(cpu_ext.available(), cpu_kernel_serves(torch.zeros(1, 2, 64)), cpu_ext.why_off())")
    off = _python(code, TANDEM_CPU_KERNELS="0")
    assert off.stdout.split()[:2] == ["False", "False"] and "TANDEM_CPU_KERNELS=0" in off.stdout, off.stderr
    failed = _python(code, CXX="/bin/false", TANDEM_CACHE=str(tmp_path))
    assert failed.stdout.split()[:2] == ["False", "False"] and "building the CPU kernels failed" in failed.stdout, \
        failed.stderr
