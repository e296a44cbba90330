"""kernels/cpu/attention_step.cpp (torch.ops.tandem_cpu.paged_attention_layer inside cpu_attention_step): the per-layer
op a whole compiled CPU forward calls, against paged_attention_cpu with its fused stores, with a graph's padding
rows, tree masks, nested steps and its errors; and one inductor graph holding two of them, serving steps whose block
tables differ in width (what engine/models/piecewise.py's "full" mode relies on)."""
import pytest
import torch

from kernels import cpu_ext
from kernels.attention import cpu_attention_step, paged_attention_cpu, paged_attention_layer

from tests.support.paged_batches import tree_case
from tests.support.paged_batches import paged_batch as make_batch

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=f"C++ CPU kernels off: {cpu_ext.why_off()}")

Hq, Hkv, D, PAGE = 6, 2, 64, 4


def _step(q_lens, seq_lens, layers=2, seed=0):
    """A paged batch whose new rows are not yet in the cache: kv [layers, 2, N, PAGE, Hkv, D] (each layer its own
    random cache), the rows' keys/values and slots, and the metadata."""
    batch, _, _ = make_batch(q_lens, seq_lens, Hq, Hkv, D, PAGE, torch.float32, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    kv = torch.stack([torch.stack([batch["k_cache"], batch["v_cache"]])] * layers).clone()
    kv[1:] += torch.randn(kv[1:].shape, generator=gen)  # NaN stays NaN: unwritten slots
    T = sum(q_lens)
    tables = batch["block_tables"].long()
    slots = torch.cat([torch.stack([tables[b, p // PAGE] * PAGE + p % PAGE for p in range(s - n, s)])
                       for b, (n, s) in enumerate(zip(q_lens, seq_lens)) if n])
    key, value = torch.randn(T, Hkv, D, generator=gen), torch.randn(T, Hkv, D, generator=gen)
    meta = dict(slot_mapping=slots, block_tables=batch["block_tables"], seq_lens=batch["seq_lens"],
                query_start_loc=batch["query_start_loc"])
    return kv, batch["query"], key, value, meta


def _want(kv, query, key, value, meta, layer, tree_mask=None):
    """paged_attention_cpu with its stores, on a copy of the layer's caches: (output, k_cache, v_cache)."""
    kc, vc = kv[layer, 0].clone(), kv[layer, 1].clone()
    out = paged_attention_cpu(query, kc, vc, meta["block_tables"], meta["seq_lens"], meta["query_start_loc"], 0.125,
                              tree_mask=tree_mask, key=key, value=value, slot_mapping=meta["slot_mapping"])
    return out, kc, vc


def _same(a, b):
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


@pytest.mark.parametrize("pad", [0, 3])
def test_layer_op_equals_the_fused_call_and_zeroes_padding_rows(pad):
    """Each layer reads and writes its own slice of the step's cache; rows past the step's (a graph's padding) come
    back zero, and their keys/values are stored nowhere."""
    q_lens, seq_lens = [1, 3, 2], [9, 14, 6]
    kv, query, key, value, meta = _step(q_lens, seq_lens)
    T = query.shape[0]
    padded = [torch.cat([x, torch.randn(pad, *x.shape[1:])]) for x in (query, key, value)]
    wants = [_want(kv, query, key, value, meta, layer) for layer in (0, 1)]
    with cpu_attention_step(kv, **meta):
        outs = [paged_attention_layer(*padded, layer, 0.125) for layer in (0, 1)]
    for out, (want, kc, vc), layer in zip(outs, wants, (0, 1)):
        assert out.shape == (T + pad, Hq, D)
        assert torch.equal(out[:T], want)
        assert torch.all(out[T:] == 0)
        assert _same(kv[layer, 0], kc) and _same(kv[layer, 1], vc)


def test_tree_masks_reach_the_layer_op():
    q_lens, seq_lens = [4, 3], [20, 11]
    kv, query, key, value, meta = _step(q_lens, seq_lens, layers=1, seed=3)
    tree, _ = tree_case(q_lens, seq_lens, 0)
    want, _, _ = _want(kv, query, key, value, meta, 0, tree_mask=tree)
    with cpu_attention_step(kv, **meta, tree_mask=tree):
        got = paged_attention_layer(query, key, value, 0, 0.125)
    assert torch.equal(got, want)


def test_nested_steps_and_errors():
    kv, query, key, value, meta = _step([1], [5], layers=1)
    with pytest.raises(RuntimeError, match="only between attention_step_begin"):
        paged_attention_layer(query, key, value, 0, 0.125)
    inner_kv, inner_q, inner_k, inner_v, inner_meta = _step([2], [7], layers=1, seed=1)
    want_inner, _, _ = _want(inner_kv, inner_q, inner_k, inner_v, inner_meta, 0)
    want_outer, _, _ = _want(kv, query, key, value, meta, 0)
    with cpu_attention_step(kv, **meta):
        with cpu_attention_step(inner_kv, **inner_meta):
            assert torch.equal(paged_attention_layer(inner_q, inner_k, inner_v, 0, 0.125), want_inner)
        assert torch.equal(paged_attention_layer(query, key, value, 0, 0.125), want_outer)  # the outer step again
        with pytest.raises(RuntimeError, match="layer 1 is not one of the cache's 1"):
            paged_attention_layer(query, key, value, 1, 0.125)
        with pytest.raises(RuntimeError, match="the step has 1"):
            paged_attention_layer(query[:0], key[:0], value[:0], 0, 0.125)
    with pytest.raises(RuntimeError, match="only between"):  # the scope ended, errors or not
        paged_attention_layer(query, key, value, 0, 0.125)


def test_one_compiled_graph_serves_steps_of_any_table_width():
    """Two attentions with a projection between, compiled once for 4 rows: steps of one request (table width 2) and
    of three (width 5, 3 real rows and a padding one) both equal the same function run eagerly."""
    from engine.layers.cpu_compile import compile_frozen

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(Hq * D, Hq * D + 2 * Hkv * D, generator=gen) * 0.05

    def two_layers(q, k, v):
        a = paged_attention_layer(q, k, v, 0, 0.125).view(q.shape[0], -1)
        q2, k2, v2 = (a @ w).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        shape = lambda x, h: x.reshape(q.shape[0], h, D)
        b = paged_attention_layer(shape(q2, Hq), shape(k2, Hkv), shape(v2, Hkv), 1, 0.125)
        return b.sum(-1) + a.sum(-1)[:, None]

    def args(T):
        return tuple(torch.randn(T, h, D, generator=gen) for h in (Hq, Hkv, Hkv))

    kv, _, _, _, meta = _step([4], [8])
    with cpu_attention_step(kv.clone(), **meta):
        compiled = compile_frozen("two attentions (4 rows)", two_layers, args(4), depth=2)
    assert compiled is not None
    for q_lens, seq_lens in (([4], [8]), ([1, 1, 1], [17, 5, 9])):
        kv, _, _, _, meta = _step(q_lens, seq_lens, seed=len(q_lens))
        x = args(4)
        eager_kv, graph_kv = kv.clone(), kv.clone()
        with cpu_attention_step(eager_kv, **meta):
            want = two_layers(*x)
        with cpu_attention_step(graph_kv, **meta):
            got = compiled(*x)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        # the stores inside the graph happened (layer 1's keys are a projection's: equal up to its rounding)
        assert not _same(graph_kv, kv)
        torch.testing.assert_close(graph_kv, eager_kv, atol=1e-4, rtol=1e-4, equal_nan=True)
