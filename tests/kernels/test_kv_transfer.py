"""kernels/kv_transfer.py: pack/unpack of KV blocks, reference and Triton, against explicit loops."""
import pytest
import torch

from kernels.kv_transfer import pack_kv, pack_kv_ref, pack_kv_triton, unpack_kv, unpack_kv_ref, unpack_kv_triton

PACKS = [pack_kv_ref, pack_kv_triton, pack_kv]
UNPACKS = [unpack_kv_ref, unpack_kv_triton, unpack_kv]


def cache(L, N, S, H, D, dtype=torch.float32, seed=0, planes=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(L, planes, N, S, H, D, generator=gen).to(dtype)


def loop_pack(kv, ids, h0, h1):
    return torch.stack([kv[:, :, int(b), :, h0:h1] for b in ids], 2) if len(ids) else kv[:, :, :0, :, h0:h1]


@pytest.mark.parametrize("fn", PACKS)
@pytest.mark.parametrize("L,N,S,H,D,n", [(1, 3, 1, 1, 1, 1), (2, 7, 4, 3, 20, 3), (3, 9, 16, 2, 64, 5), (2, 4, 5, 4, 8, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("planes", [2, 1])
def test_pack(fn, L, N, S, H, D, n, dtype, planes):
    kv = cache(L, N, S, H, D, dtype, planes=planes)
    ids = torch.randperm(N, generator=torch.Generator().manual_seed(n))[:n]
    buf = fn(kv, ids)
    assert buf.is_contiguous() and buf.shape == (L, planes, n, S, H, D)
    assert torch.equal(buf, loop_pack(kv, ids, 0, H))


@pytest.mark.parametrize("fn", PACKS)
@pytest.mark.parametrize("h0,h1", [(0, 2), (2, 4), (1, 3), (3, 4)])
def test_pack_head_slice_into_out(fn, h0, h1):
    kv = cache(2, 6, 4, 4, 16)
    ids = torch.tensor([5, 0, 3])
    out = torch.full((2, 2, 3, 4, h1 - h0, 16), float("nan"))
    ret = fn(kv, ids, out, h0, h1)
    assert ret.data_ptr() == out.data_ptr()
    assert torch.equal(out, loop_pack(kv, ids, h0, h1))


@pytest.mark.parametrize("fn", UNPACKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unpack_round_trip_into_other_cache(fn, dtype):
    """Prefill cache with 7 blocks -> decode cache with 11: only the target blocks change."""
    src = cache(3, 7, 4, 2, 12, dtype, seed=1)
    dst = cache(3, 11, 4, 2, 12, dtype, seed=2)
    before = dst.clone()
    src_ids, dst_ids = torch.tensor([6, 1, 2]), torch.tensor([0, 10, 4])
    fn(pack_kv_ref(src, src_ids), dst, dst_ids)
    for s, d in zip(src_ids.tolist(), dst_ids.tolist()):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = [b for b in range(11) if b not in dst_ids.tolist()]
    assert torch.equal(dst[:, :, untouched], before[:, :, untouched])


@pytest.mark.parametrize("pack,unpack", [(pack_kv_ref, unpack_kv_ref), (pack_kv_triton, unpack_kv_triton)])
def test_tp_split_and_merge(pack, unpack):
    """tp=1 -> two tp=2 ranks (head halves), and back: the merged cache equals the original blocks."""
    full = cache(2, 5, 4, 4, 8, seed=3)
    ids = torch.tensor([4, 2])
    ranks = [torch.zeros(2, 2, 3, 4, 2, 8) for _ in range(2)]
    for r in range(2):
        unpack(pack(full, ids, None, 2 * r, 2 * r + 2), ranks[r], torch.tensor([1, 0]))
        assert torch.equal(ranks[r][:, :, [1, 0]], full[:, :, ids, :, 2 * r : 2 * r + 2])
    merged = torch.zeros(2, 2, 6, 4, 4, 8)
    for r in range(2):
        unpack(pack(ranks[r], torch.tensor([1, 0])), merged, torch.tensor([3, 5]), head_start=2 * r)
    assert torch.equal(merged[:, :, [3, 5]], full[:, :, ids])


@pytest.mark.parametrize("pack,unpack", [(pack_kv_ref, unpack_kv_ref), (pack_kv_triton, unpack_kv_triton)])
def test_mla_latent_goes_whole_to_every_rank(pack, unpack):
    """An MLA cache (one plane, one latent "head" of kv_lora_rank + qk_rope_head_dim = 40, target + MTP layer):
    each tp=2 rank's cache holds the whole latent, so both get the same full buffer; odd sizes throughout."""
    full = cache(4, 7, 3, 1, 40, planes=1, seed=5)
    ids = torch.tensor([6, 0, 3])
    buf = pack(full, ids, None, 0, 1)
    assert buf.shape == (4, 1, 3, 3, 1, 40)
    for r in range(2):
        rank = torch.zeros(4, 1, 5, 3, 1, 40)
        unpack(buf, rank, torch.tensor([4, 1, 2]))
        assert torch.equal(rank[:, :, [4, 1, 2]], full[:, :, ids])
        assert not rank[:, :, [0, 3]].any()


def test_noncontiguous_layer_view():
    """A cache that is a view (e.g. every other layer of a bigger tensor) packs by its strides."""
    big = cache(4, 5, 4, 2, 8, seed=4)
    kv = big[::2]
    ids = torch.tensor([3, 1])
    assert torch.equal(pack_kv_triton(kv, ids), loop_pack(kv, ids, 0, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_pack_unpack_cuda(dtype):
    kv = cache(4, 64, 16, 8, 128, dtype).cuda()
    ids = torch.randperm(64)[:20].cuda()
    buf = pack_kv_triton(kv, ids, None, 4, 8)
    assert torch.equal(buf.cpu(), loop_pack(kv.cpu(), ids.cpu(), 4, 8))
    dst = torch.zeros(4, 2, 30, 16, 8, 128, dtype=dtype, device="cuda")
    unpack_kv_triton(buf, dst, torch.arange(20, device="cuda"), head_start=4)
    assert torch.equal(dst[:, :, :20, :, 4:].cpu(), buf.cpu())


@pytest.mark.gpu
def test_pack_unpack_mla_latent_cuda():
    """DeepSeek-V3's cache row: one plane, one latent "head" of 512 + 64, 61 layers + the MTP layer."""
    kv = cache(62, 48, 64, 1, 576, torch.bfloat16, planes=1).cuda()
    ids = torch.randperm(48)[:13].cuda()
    buf = pack_kv_triton(kv, ids)
    assert torch.equal(buf.cpu(), loop_pack(kv.cpu(), ids.cpu(), 0, 1))
    dst = torch.zeros(62, 1, 20, 64, 1, 576, dtype=torch.bfloat16, device="cuda")
    unpack_kv_triton(buf, dst, torch.arange(13, device="cuda"))
    assert torch.equal(dst[:, :, :13].cpu(), buf.cpu())
