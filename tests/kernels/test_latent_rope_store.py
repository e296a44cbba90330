"""kernels/latent_rope_store.py: the latent's norm, the rope key's and query's rotation and the latent cache store of
MLA in one launch, the Triton kernel (interpreted here) against its reference, and the reference against the three
steps it fuses (rms_norm_ref, apply_rope_ref, store_latent_ref)."""
import pytest
import torch

from kernels.latent_rope_store import latent_rope_store, latent_rope_store_ref, latent_rope_store_triton
from kernels.mla_attention import store_latent_ref
from kernels.norm_rope import apply_rope_ref, build_rope_cache, rms_norm_ref

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2), torch.float16: (1e-3, 1e-3)}
T, H, NOPE, L, R, N, S = 6, 3, 8, 32, 16, 5, 4


def _case(dtype, cache_dtype, seed=0):
    """Views of the projections as the engine has them: q [T, H, nope | rope] and kv_a [T, L | R]."""
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(T, H, NOPE + R, generator=gen) * 2).to(dtype)
    kv_a = (torch.randn(T, L + R, generator=gen) * 3).to(dtype)
    latent, key = kv_a.split([L, R], -1)
    q_rope = q[..., NOPE:]
    positions = torch.randint(0, 50, (T,), generator=gen)
    cos_sin = build_rope_cache(R, 50, 10000.0, None)
    weight = (torch.rand(L, generator=gen) + 0.5).to(dtype)
    cache = torch.randn(N, S, L + R, generator=gen).to(cache_dtype)
    slots = torch.tensor([3, -1, 17, 4, -1, 9])  # -1: padding rows store nothing
    return latent, key, q_rope, positions, cos_sin, weight, cache, slots


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16), (torch.float32, torch.bfloat16)])
def test_triton_matches_norm_rope_then_store(dtype, cache_dtype):
    latent, key, q_rope, positions, cos_sin, weight, cache, slots = _case(dtype, cache_dtype, seed=3)
    want_cache, got_cache = cache.clone(), cache.clone()
    want_q = latent_rope_store_ref(latent, key, q_rope, positions, cos_sin, weight, 1e-6, want_cache, slots)
    # the reference is the three steps it fuses
    steps_cache = cache.clone()
    q, k = apply_rope_ref(q_rope, key[:, None], positions, cos_sin)
    store_latent_ref(rms_norm_ref(latent, weight, 1e-6), k[:, 0], steps_cache, slots)
    assert torch.equal(want_q, q) and torch.equal(want_cache, steps_cache)
    got_q = latent_rope_store_triton(latent, key, q_rope, positions, cos_sin, weight, 1e-6, got_cache, slots)
    torch.testing.assert_close(got_q, want_q, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    tol = TOL[cache_dtype] if cache_dtype != dtype else TOL[dtype]
    torch.testing.assert_close(got_cache, want_cache, atol=tol[0], rtol=tol[1])
    # padding rows wrote nothing; the other slots are untouched
    written = torch.zeros(N * S, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    assert torch.equal(got_cache.view(N * S, -1)[~written], cache.view(N * S, -1)[~written])


def test_dispatcher_takes_the_reference_on_the_cpu():
    latent, key, q_rope, positions, cos_sin, weight, cache, slots = _case(torch.float32, torch.float32, seed=5)
    a, b = cache.clone(), cache.clone()
    torch.testing.assert_close(latent_rope_store(latent, key, q_rope, positions, cos_sin, weight, 1e-6, a, slots),
                               latent_rope_store_ref(latent, key, q_rope, positions, cos_sin, weight, 1e-6, b, slots))
    assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_latent_rope_store_cuda(dtype):
    latent, key, q_rope, positions, cos_sin, weight, cache, slots = _case(dtype, dtype, seed=7)
    want_cache = cache.clone()
    want_q = latent_rope_store_ref(latent, key, q_rope, positions, cos_sin, weight, 1e-6, want_cache, slots)
    gpu_cache = cache.cuda()
    got_q = latent_rope_store_triton(latent.cuda(), key.cuda(), q_rope.cuda(), positions.cuda(), cos_sin.cuda(),
                                     weight.cuda(), 1e-6, gpu_cache, slots.cuda())
    torch.testing.assert_close(got_q.cpu(), want_q, atol=TOL[dtype][0], rtol=TOL[dtype][1])
    torch.testing.assert_close(gpu_cache.cpu(), want_cache, atol=TOL[dtype][0], rtol=TOL[dtype][1])
