"""kernels/cpu/decoder_stack.cpp (torch.ops.tandem_cpu.decoder_stack): a small random Llama stack's forward against
the same forward written in plain torch (fp64), for 1-16 rows, fp32 and bf16 packed weights, with and without the
optional parts (q/k/v, output and MLP biases; q/k norms; partial rotary), the KV it writes, and its errors."""
import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_ext
from kernels.attention import cpu_attention_step
from kernels.decoder_stack import SLOTS, decoder_stack
from kernels.linear_rows import pack_rows
from kernels.norm_rope import rope_rows

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason=f"C++ CPU kernels off: {cpu_ext.why_off()}")

H, HQ, HKV, D, I, V, L, EPS = 64, 4, 2, 16, 96, 50, 3, 1e-5


def _layer(gen, bias: bool, qk_norm: bool, gate_scale: float = 0.6) -> dict:
    def w(*shape, s=0.3):
        return torch.randn(*shape, generator=gen) * s

    out = {"input_norm": 1 + w(H, s=0.1), "qkv": w((HQ + 2 * HKV) * D, H), "o": w(H, HQ * D),
           "post_norm": 1 + w(H, s=0.1), "gate_up": w(2 * I, H, s=gate_scale), "down": w(H, I)}
    if bias:
        out |= {"qkv_bias": w((HQ + 2 * HKV) * D), "o_bias": w(H), "gate_up_bias": w(2 * I), "down_bias": w(H)}
    if qk_norm:
        out |= {"q_norm": 1 + w(D, s=0.1), "k_norm": 1 + w(D, s=0.1)}
    return out


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rope(x, cos2, sin2, R):
    """x [T, heads, D]: rotate-half over the first R dims (kernels/norm_rope.py's reference arithmetic)."""
    xr, half = x[..., :R], R // 2
    y = xr * cos2 + torch.cat([xr[..., half:], xr[..., :half]], -1) * sin2
    return torch.cat([y, x[..., R:]], -1)


def _reference(ids, embed, cos2, sin2, layers, final_norm):
    """Plain torch, fp64: (final, stream after the last block, streams after the others, each layer's (k, v))."""
    d = {k: v.double() for k, v in {"embed": embed, "cos2": cos2, "sin2": sin2}.items()}
    R = cos2.shape[-1]
    T = ids.shape[0]
    stream, h, streams, kvs = d["embed"][ids], None, [], []
    for i, lw in enumerate(layers):
        lw = {k: v.double() for k, v in lw.items()}
        if i:
            stream = stream + h
            streams.append(stream)
        h = _rms(stream, lw["input_norm"])
        q, k, v = F.linear(h, lw["qkv"], lw.get("qkv_bias")).split([HQ * D, HKV * D, HKV * D], -1)
        q, k, v = q.view(T, HQ, D), k.view(T, HKV, D), v.view(T, HKV, D)
        if "q_norm" in lw:
            q, k = _rms(q, lw["q_norm"]), _rms(k, lw["k_norm"])
        q, k = _rope(q, d["cos2"], d["sin2"], R), _rope(k, d["cos2"], d["sin2"], R)
        kvs.append((k, v))
        rep = HQ // HKV
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                           v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
                                           scale=D ** -0.5)
        stream = stream + F.linear(a.transpose(0, 1).reshape(T, HQ * D), lw["o"], lw.get("o_bias"))
        h = _rms(stream, lw["post_norm"])
        gate, up = F.linear(h, lw["gate_up"], lw.get("gate_up_bias")).chunk(2, -1)
        h = F.linear(F.silu(gate) * up, lw["down"], lw.get("down_bias"))
    stream = stream + h
    return _rms(stream, final_norm.double()), stream, streams, kvs


def _run(T, packed_dtype, bias, qk_norm, rotary, seed=0, gate_scale=0.6):
    gen = torch.Generator().manual_seed(seed)
    layers = [_layer(gen, bias, qk_norm, gate_scale) for _ in range(L)]
    embed, final_norm = torch.randn(V, H, generator=gen), 1 + 0.1 * torch.randn(H, generator=gen)
    ids = torch.randint(0, V, (T,), generator=gen)
    theta = 10000 ** (-torch.arange(0, rotary, 2).double() / rotary)
    ang = torch.arange(64).double()[:, None] * theta[None]
    cos_sin = torch.cat([ang.cos(), ang.sin()], -1).float()  # [max_pos, R]
    cos2, sin2 = rope_rows(torch.arange(T), cos_sin)
    if packed_dtype == torch.bfloat16:  # the reference reads the weights' bf16 values
        for lw in layers:
            for name in ("qkv", "o", "gate_up", "down"):
                lw[name] = lw[name].to(torch.bfloat16).float()
    weights = [pack_rows(lw[s].to(packed_dtype)) if s in ("qkv", "o", "gate_up", "down") else lw.get(s)
               for lw in layers for s in SLOTS]
    kv = torch.zeros(L, 2, 2, 16, HKV, D)
    with cpu_attention_step(kv, torch.arange(16, 16 + T), torch.tensor([[1]], dtype=torch.int32),
                            torch.tensor([T], dtype=torch.int32), torch.tensor([0, T], dtype=torch.int32)):
        got = decoder_stack(ids, embed.t().contiguous().t(), cos2, sin2, weights, final_norm, list(range(L)), HQ, HKV,
                            D, I, EPS, D ** -0.5)
    return got, _reference(ids, embed, cos2, sin2, layers, final_norm), kv


@pytest.mark.parametrize("T", [1, 2, 5, 16])
@pytest.mark.parametrize("packed_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias,qk_norm,rotary", [(False, False, D), (True, True, D), (False, True, D // 2)],
                         ids=["llama", "bias-qknorm", "partial-rotary"])
def test_equals_plain_torch(T, packed_dtype, bias, qk_norm, rotary):
    got, (final, stream, streams, kvs), kv = _run(T, packed_dtype, bias, qk_norm, rotary, seed=T)
    assert len(got) == 2 + L - 1 and all(g.dtype == torch.float32 and g.shape == (T, H) for g in got)
    for g, w in zip(got, (final, stream, *streams)):
        # fp32 against a float64 reference: the stream grows to ~300 here, and fp32 sums (whose order the kernels
        # choose: 8-lane softmax sums, blocked dot products) carry ~2e-6 of the largest value into every element
        torch.testing.assert_close(g.double(), w, atol=4e-6 * float(w.abs().max()), rtol=2e-4)
    for layer, (k, v) in enumerate(kvs):  # the rows written to the cache (block 1) are the rotated keys and values
        torch.testing.assert_close(kv[layer, 0, 1, :T].double(), k, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(kv[layer, 1, 1, :T].double(), v, atol=2e-4, rtol=2e-4)


def test_silu_of_large_activations():
    """Gate values of several hundred either side (far outside exp's fp32 range): SiLU is x or 0 there, never inf or
    NaN, and the output still equals the reference's."""
    got, (final, stream, streams, _), _ = _run(4, torch.float32, False, False, D, seed=9, gate_scale=40.0)
    assert all(torch.isfinite(g).all() for g in got)
    for g, w in zip(got, (final, stream, *streams)):  # values in the thousands: fp32 sums of them differ by ~1e-4
        torch.testing.assert_close(g.double(), w, atol=1e-3, rtol=1e-3)


def test_given_input_rows_equal_the_embedded_ids():
    """A draft head's block is handed its first input as rows [T, H] (not token ids): the op then runs the same stack
    on them, so rows equal to embed[ids] give the ids' outputs exactly; rows of another dtype or width are refused."""
    gen = torch.Generator().manual_seed(4)
    layer = _layer(gen, False, False)
    weights = [pack_rows(layer[s]) if s in ("qkv", "o", "gate_up", "down") else layer.get(s) for s in SLOTS]
    embed = torch.randn(V, H, generator=gen)
    ids = torch.randint(0, V, (3,), generator=gen)
    cos2, sin2 = rope_rows(torch.arange(3), torch.randn(8, D, generator=gen))
    outs = []
    for first in (ids, embed[ids].clone()):
        kv = torch.zeros(1, 2, 2, 16, HKV, D)
        with cpu_attention_step(kv, torch.arange(16, 19), torch.tensor([[1]], dtype=torch.int32),
                                torch.tensor([3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)):
            outs.append(decoder_stack(first, embed, cos2, sin2, weights, torch.ones(H), [0], HQ, HKV, D, I, EPS,
                                      D ** -0.5))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    for bad in (embed[ids].double(), torch.randn(3, H + 1)):
        with pytest.raises(RuntimeError, match="first block's input"):
            decoder_stack(bad, embed, cos2, sin2, weights, torch.ones(H), [0], HQ, HKV, D, I, EPS, 1.0)


def test_errors_name_what_is_wrong():
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(V, H, generator=gen)
    cos2, sin2 = rope_rows(torch.arange(1), torch.randn(8, D))
    with pytest.raises(RuntimeError, match="weight slots per layer"):
        decoder_stack(torch.tensor([1]), embed, cos2, sin2, [None] * 5, torch.ones(H), [0], HQ, HKV, D, I, EPS, 1.0)
    with pytest.raises(RuntimeError, match="must be an fp32"):  # a missing norm
        decoder_stack(torch.tensor([1]), embed, cos2, sin2, [None] * len(SLOTS), torch.ones(H), [0], HQ, HKV, D, I,
                      EPS, 1.0)
    gen_layer = _layer(gen, False, False)
    weights = [pack_rows(gen_layer[s]) if s in ("qkv", "o", "gate_up", "down") else gen_layer.get(s) for s in SLOTS]
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        decoder_stack(torch.tensor([V + 3]), embed, cos2, sin2, weights, torch.ones(H), [0], HQ, HKV, D, I, EPS, 1.0)
    with pytest.raises(RuntimeError, match="final_norm"):
        decoder_stack(torch.tensor([1]), embed, cos2, sin2, weights, torch.ones(H + 1), [0], HQ, HKV, D, I, EPS, 1.0)
    weights[SLOTS.index("q_norm")] = torch.ones(D)
    with pytest.raises(RuntimeError, match="q norm without a k norm"):
        decoder_stack(torch.tensor([1]), embed, cos2, sin2, weights, torch.ones(H), [0], HQ, HKV, D, I, EPS, 1.0)
    weights[SLOTS.index("k_norm")] = torch.ones(D - 1)
    with pytest.raises(RuntimeError, match="head_dim"):
        decoder_stack(torch.tensor([1]), embed, cos2, sin2, weights, torch.ones(H), [0], HQ, HKV, D, I, EPS, 1.0)
