"""kernels/norm_rope.py: RMSNorm and rotary embedding against transformers' Llama modules, and
Triton against the reference."""
import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from kernels.norm_rope import (
    apply_rope,
    apply_rope_ref,
    apply_rope_triton,
    rope_rows,
    build_rope_cache,
    rms_norm,
    rms_norm_cat,
    rms_norm_cat_ref,
    rms_norm_cat_triton,
    rms_norm_ref,
    rms_norm_triton,
    rope_store_kv,
    rope_store_kv_ref,
    rope_store_kv_triton,
)

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2), torch.float16: (2e-3, 2e-3)}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def hf_rotary(head_dim, theta, scaling, max_pos):
    params = {"rope_type": "default", "rope_theta": theta} if scaling is None else dict(scaling, rope_theta=theta)
    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                      max_position_embeddings=max_pos, rope_parameters=params)
    return LlamaRotaryEmbedding(cfg)


@pytest.mark.parametrize("scaling", [None, LLAMA3, {"rope_type": "linear", "factor": 4.0}])
@pytest.mark.parametrize("head_dim", [64, 128, 48])
def test_rope_cache_matches_transformers(scaling, head_dim):
    rot = hf_rotary(head_dim, 500000.0, scaling, 256)
    pos = torch.arange(256)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32), pos)
    ours = build_rope_cache(head_dim, 256, 500000.0, scaling)
    assert torch.equal(ours[:, : head_dim // 2], cos[0, :, : head_dim // 2])
    assert torch.equal(ours[:, head_dim // 2 :], sin[0, :, : head_dim // 2])


def test_llama3_scaling_changes_low_frequencies_only():
    plain = build_rope_cache(128, 4, 500000.0, None)
    scaled = build_rope_cache(128, 4, 500000.0, LLAMA3)
    # wavelengths below 64 / high_freq_factor = 16 keep their frequency; the longest are divided by 8
    assert torch.equal(plain[:, :3], scaled[:, :3]) and torch.equal(plain[:, 64:67], scaled[:, 64:67])
    torch.testing.assert_close(scaled[:, 127], torch.sin(torch.arange(4.0) * (500000.0 ** (-126 / 128)) / 8))


@pytest.mark.parametrize("fn", [apply_rope_ref, apply_rope_triton, apply_rope])
@pytest.mark.parametrize("Hq,Hkv,D", [(4, 2, 64), (3, 1, 128), (5, 5, 6)])
def test_rope_matches_transformers(fn, Hq, Hkv, D):
    gen = torch.Generator().manual_seed(D)
    T = 7
    qkv = torch.randn(T, Hq + 2 * Hkv, D, generator=gen)  # q/k as strided views of a fused projection
    q, k = qkv[:, :Hq], qkv[:, Hq : Hq + Hkv]
    positions = torch.tensor([0, 5, 3, 3, 60, 1, 99])
    rot = hf_rotary(D, 10000.0, LLAMA3, 128)
    cos, sin = rot(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q, got_k = fn(q, k, positions, build_rope_cache(D, 128, 10000.0, LLAMA3))
    torch.testing.assert_close(got_q, want_q[0].transpose(0, 1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k[0].transpose(0, 1), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype,rotary_dim", [(torch.float32, 64), (torch.float32, 32), (torch.bfloat16, 64)])
def test_rope_ref_rows_is_the_rotation_exactly(dtype, rotary_dim):
    """The reference rotates as [x1, x2] * [cos, cos] + [x2, x1] * [-sin, sin] with tables gathered once
    per forward (rope_rows): bit for bit the textbook [x1 cos - x2 sin, x2 cos + x1 sin] in fp32, rounded
    once, features past rotary_dim passed through."""
    gen = torch.Generator().manual_seed(rotary_dim)
    q = torch.randn(5, 3, 64, generator=gen).to(dtype)
    k = torch.randn(5, 1, 64, generator=gen).to(dtype)
    positions = torch.tensor([0, 9, 2, 2, 40])
    cache = build_rope_cache(rotary_dim, 50, 10000.0, None)
    half = rotary_dim // 2
    cs = cache[positions][:, None]
    cos, sin = cs[..., :half], cs[..., half:]

    def textbook(x):
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rotary_dim:]], -1).to(dtype)

    for got in (apply_rope_ref(q, k, positions, cache), apply_rope_ref(q, k, positions, cache, rope_rows(positions, cache))):
        assert torch.equal(got[0], textbook(q)) and torch.equal(got[1], textbook(k))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rotary_dim", [32, 64])
def test_rope_triton_vs_ref_dtypes_partial(dtype, rotary_dim):
    gen = torch.Generator().manual_seed(rotary_dim)
    q = torch.randn(9, 6, 64, generator=gen).to(dtype)
    k = torch.randn(9, 2, 64, generator=gen).to(dtype)
    positions = torch.randint(0, 50, (9,), generator=gen)
    cache = build_rope_cache(rotary_dim, 50, 10000.0, None, dtype=torch.float32)
    want = apply_rope_ref(q, k, positions, cache)
    got = apply_rope_triton(q, k, positions, cache)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    assert torch.equal(got[0][..., rotary_dim:], q[..., rotary_dim:]), "features past rotary_dim pass through"


@pytest.mark.parametrize("fn", [rms_norm_ref, rms_norm_triton, rms_norm])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("T,H", [(1, 64), (5, 100), (3, 1024), (0, 32)])
def test_rms_norm_matches_transformers(fn, dtype, T, H):
    gen = torch.Generator().manual_seed(H)
    x = (torch.randn(T, H, generator=gen) * 3).to(dtype)
    res = torch.randn(T, H, generator=gen).to(dtype)
    hf = LlamaRMSNorm(H, eps=1e-6).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(H, generator=gen))
    w = hf.weight.detach()
    with torch.no_grad():
        torch.testing.assert_close(fn(x, w, 1e-6), hf(x), atol=TOL[dtype][0], rtol=TOL[dtype][1])
        out, new_res = fn(x, w, 1e-6, res)
        assert torch.equal(new_res, x + res)
        torch.testing.assert_close(out, hf(x + res), atol=TOL[dtype][0], rtol=TOL[dtype][1])


@pytest.mark.parametrize("fn", [rms_norm_ref, rms_norm_triton])
def test_rms_norm_per_head_of_a_strided_view(fn):
    """Qwen3's q/k norm: [T, heads, D] views of a fused projection, normalized per head. The Triton wrapper
    took only [T, H] and raised on this shape (found by kernels/compile_check.py, Qwen3-8B)."""
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, 4 + 2 * 2, 32, generator=gen)
    q = qkv[:, :4]  # [5, 4, 32], not contiguous
    w = torch.randn(32, generator=gen)
    want = LlamaRMSNorm(32, eps=1e-6)
    with torch.no_grad():
        want.weight.copy_(w)
        torch.testing.assert_close(fn(q, w, 1e-6), want(q), atol=1e-5, rtol=1e-5)
        res = torch.randn(5, 4, 32, generator=gen)
        out, new_res = fn(q, w, 1e-6, res)
        assert out.shape == new_res.shape == q.shape and torch.equal(new_res, q + res)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_norm_rope_cuda(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, 4096, generator=gen).to(dtype)
    res = torch.randn(33, 4096, generator=gen).to(dtype)
    w = torch.randn(4096, generator=gen).to(dtype)
    want = rms_norm_ref(x, w, 1e-5, res)
    got = rms_norm_triton(x.cuda(), w.cuda(), 1e-5, res.cuda())
    for g, r in zip(got, want):
        torch.testing.assert_close(g.cpu(), r, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    q = torch.randn(33, 32, 128, generator=gen).to(dtype)
    k = torch.randn(33, 8, 128, generator=gen).to(dtype)
    pos = torch.randint(0, 8192, (33,), generator=gen)
    cache = build_rope_cache(128, 8192, 500000.0, dict(LLAMA3, original_max_position_embeddings=8192))
    want = apply_rope_ref(q, k, pos, cache)
    got = apply_rope_triton(q.cuda(), k.cuda(), pos.cuda(), cache.cuda())
    for g, r in zip(got, want):
        torch.testing.assert_close(g.cpu(), r, atol=TOL[dtype][0], rtol=TOL[dtype][1])


YARN = [
    # DeepSeek-V3's shape: mscale = mscale_all_dim (attention factor 1)
    {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    # mscale != mscale_all_dim: the table itself is scaled
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8},
    # neither: attention factor from the factor alone
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
]


@pytest.mark.parametrize("scaling", YARN)
@pytest.mark.parametrize("head_dim", [64, 8])
def test_yarn_rope_cache_matches_transformers(scaling, head_dim):
    """YaRN frequencies and attention factor as transformers' DeepSeek-V3 rotary embedding computes them."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    cfg = DeepseekV3Config(hidden_size=128, num_attention_heads=2, qk_rope_head_dim=head_dim, max_position_embeddings=512,
                           rope_parameters=dict(scaling, rope_theta=10000.0))
    cos, sin = DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1), torch.arange(512)[None])
    ours = build_rope_cache(head_dim, 512, 10000.0, scaling)
    torch.testing.assert_close(ours[:, : head_dim // 2], cos[0, :, : head_dim // 2], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours[:, head_dim // 2:], sin[0, :, : head_dim // 2], atol=1e-6, rtol=0)
    assert not torch.equal(ours, build_rope_cache(head_dim, 512, 10000.0, None))


# ------------------------------------------------------------------------------- two norms side by side


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_cat_triton_matches_two_norms_and_a_cat(dtype):
    """A draft head's input: [norm_a(a) | norm_b(b)] in one launch, a strided (a view of a wider tensor) and b not."""
    gen = torch.Generator().manual_seed(4)
    T, H = 5, 48
    a = (torch.randn(T, H + 16, generator=gen) * 3).to(dtype)[:, 16:]
    b = torch.randn(T, H, generator=gen).to(dtype)
    wa, wb = (torch.rand(H, generator=gen) + 0.5).to(dtype), (torch.rand(H, generator=gen) + 0.5).to(dtype)
    want = rms_norm_cat_ref(a, wa, b, wb, 1e-5)
    assert torch.equal(want, torch.cat([rms_norm_ref(a, wa, 1e-5), rms_norm_ref(b, wb, 1e-5)], -1))
    got = rms_norm_cat_triton(a, wa, b, wb, 1e-5)
    assert got.shape == (T, 2 * H) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    torch.testing.assert_close(rms_norm_cat(a, wa, b, wb, 1e-5), want, atol=TOL[dtype][0], rtol=TOL[dtype][1])


# ------------------------------------------------------------------------------- rotary + KV store, fused


def _rope_store_case(dtype, cache_dtype, rotary_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    T, HQ, HK, D, N, S = 6, 6, 2, 64, 5, 4
    qkv = torch.randn(T, HQ + 2 * HK, D, generator=gen).to(dtype)  # views of a fused projection, as the engine has
    q, k, v = qkv[:, :HQ], qkv[:, HQ:HQ + HK], qkv[:, HQ + HK:]
    positions = torch.randint(0, 50, (T,), generator=gen)
    slots = torch.tensor([3, -1, 17, 4, -1, 9])  # -1: padding rows store nothing
    cache = build_rope_cache(rotary_dim, 50, 10000.0, None)
    caches = [torch.randn(N, S, HK, D, generator=gen).to(cache_dtype) for _ in range(2)]
    return q, k, v, positions, cache, caches, slots


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_store_kv_triton_matches_rope_then_store(dtype, cache_dtype, rotary_dim):
    q, k, v, positions, cache, caches, slots = _rope_store_case(dtype, cache_dtype, rotary_dim, rotary_dim)
    want_caches = [c.clone() for c in caches]
    want_q = rope_store_kv_ref(q, k, v, positions, cache, *want_caches, slots)
    got_q = rope_store_kv_triton(q, k, v, positions, cache, *caches, slots)
    ref_q, ref_k = apply_rope_ref(q, k, positions, cache)
    assert torch.equal(want_q, ref_q)  # the reference is the two steps it fuses
    tol = TOL[dtype] if dtype == cache_dtype else TOL[cache_dtype]
    torch.testing.assert_close(got_q, want_q, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    for got, want in zip(caches, want_caches):
        torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1])
    flat = caches[0].view(-1, *caches[0].shape[2:])
    torch.testing.assert_close(flat[slots[0]], ref_k[0].to(cache_dtype), atol=tol[0], rtol=tol[1])


def _qk_norm(dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(64, generator=gen) + 0.5).to(dtype), (torch.rand(64, generator=gen) + 0.5).to(dtype), 1e-6


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_store_kv_with_qk_norm_matches_norm_rope_then_store(dtype, cache_dtype, rotary_dim):
    """Qwen3: q and k RMS-normed per head (their own weights) before the rotation, in the same launch; the reference
    is rms_norm_ref per head, then rotate-and-store, and the kernel matches it (the features past rotary_dim normed
    too, passed through unrotated)."""
    q, k, v, positions, cache, caches, slots = _rope_store_case(dtype, cache_dtype, rotary_dim, 7 + rotary_dim)
    qk_norm = _qk_norm(dtype)
    want_caches = [c.clone() for c in caches]
    want_q = rope_store_kv_ref(q, k, v, positions, cache, *want_caches, slots, qk_norm)
    normed = rms_norm_ref(q, qk_norm[0], qk_norm[2]), rms_norm_ref(k, qk_norm[1], qk_norm[2])
    assert torch.equal(want_q, apply_rope_ref(*normed, positions, cache)[0])  # the reference is the steps it fuses
    assert not torch.allclose(want_q.float(), apply_rope_ref(q, k, positions, cache)[0].float(), atol=0.1)
    got_q = rope_store_kv_triton(q, k, v, positions, cache, *caches, slots, qk_norm)
    tol = TOL[dtype] if dtype == cache_dtype else TOL[cache_dtype]
    torch.testing.assert_close(got_q, want_q, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    for got, want in zip(caches, want_caches):
        torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1])


def test_rope_store_kv_leaves_every_other_slot_alone():
    q, k, v, positions, cache, caches, slots = _rope_store_case(torch.float32, torch.float32, 64)
    before = [c.clone() for c in caches]
    rope_store_kv_triton(q, k, v, positions, cache, *caches, slots)
    written = torch.zeros(caches[0].shape[0] * caches[0].shape[1], dtype=torch.bool)
    written[slots[slots >= 0]] = True
    for got, old in zip(caches, before):
        assert torch.equal(got.view(written.shape[0], -1)[~written], old.view(written.shape[0], -1)[~written])
        assert not torch.equal(got.view(written.shape[0], -1)[written], old.view(written.shape[0], -1)[written])


def test_rope_store_kv_dispatcher_matches_ref():
    q, k, v, positions, cache, caches, slots = _rope_store_case(torch.float32, torch.float32, 64, 3)
    want_caches = [c.clone() for c in caches]
    torch.testing.assert_close(rope_store_kv(q, k, v, positions, cache, *caches, slots),
                               rope_store_kv_ref(q, k, v, positions, cache, *want_caches, slots))
    for got, want in zip(caches, want_caches):
        torch.testing.assert_close(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_store_kv_cuda(dtype, norm):
    q, k, v, positions, cache, caches, slots = _rope_store_case(dtype, dtype, 64, 5)
    qk_norm = _qk_norm(dtype) if norm else None
    want_caches = [c.clone() for c in caches]
    want_q = rope_store_kv_ref(q, k, v, positions, cache, *want_caches, slots, qk_norm)
    gpu_caches = [c.cuda() for c in caches]
    got_q = rope_store_kv_triton(q.cuda(), k.cuda(), v.cuda(), positions.cuda(), cache.cuda(), *gpu_caches,
                                 slots.cuda(), None if qk_norm is None else (qk_norm[0].cuda(), qk_norm[1].cuda(),
                                                                               qk_norm[2]))
    torch.testing.assert_close(got_q.cpu(), want_q, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    for got, want in zip(gpu_caches, want_caches):
        torch.testing.assert_close(got.cpu(), want, atol=TOL[dtype][0], rtol=TOL[dtype][1])
