"""kernels/tree_accept.py: a verified tree's accepted path made a chain (its KV moved into place in every layer, the
rows permuted, the next tokens set), the Triton kernel (interpreted here) equal to its torch reference, for KV caches
of several widths and dtypes, graph padding requests (slot -1) included, and the reference equal to its rule."""
import pytest
import torch

from kernels.tree_accept import accept_path_ref, accept_path_triton
from kernels.tree_walk import walk_ref
from tests.support.draft_trees import follow_a_branch, random_parents


def _step(B: int, N: int, depth: int, seed: int, pad: int = 0, blocks: int = 40):
    """B requests of N + 1 rows (root, depth-ordered nodes) after 3 prompt rows, `pad` of them a graph's padding
    requests (slot -1), with a path walked down each tree."""
    g = torch.Generator().manual_seed(seed)
    parents = random_parents(B, N, depth, g)
    drafts = 10 + torch.arange(N)[None, :].repeat(B, 1)
    target = follow_a_branch(parents, drafts, depth, g, root_accepts=True)  # every root accepts a child
    num = torch.full((B,), N)
    path, accepted, _ = walk_ref(target, drafts, parents, num, depth)
    vr = 3 + torch.arange(B)[:, None] * (N + 1) + torch.arange(N + 1)[None, :]
    T = 3 + B * (N + 1)
    slot_mapping = torch.randperm((blocks - 1) * 4, generator=g)[:T]  # never the scratch block (the cache's last)
    for b in range(B - pad, B):
        slot_mapping[vr[b]] = -1
    tokens = torch.where(torch.arange(depth + 1)[None, :] <= accepted[:, None], torch.randint(0, 99, (B, depth + 1),
                         generator=g), -1)
    samples = torch.rand(B, generator=g) < 0.5
    next_tokens = torch.randint(0, 99, (T,), generator=g)
    return slot_mapping, vr, path, accepted, next_tokens, tokens, samples


@pytest.mark.parametrize("B,N,depth,pad,tail,dtype", [
    (1, 8, 3, 0, (3, 64), torch.float32), (4, 8, 4, 1, (2, 16), torch.bfloat16), (3, 16, 8, 0, (1, 8), torch.float16),
    (2, 4, 4, 1, (96,), torch.float32)])  # (96,): one latent plane of an MLA cache
def test_triton_equals_reference(B, N, depth, pad, tail, dtype):
    slot_mapping, vr, path, accepted, next_tokens, tokens, samples = _step(B, N, depth, seed=B * 10 + N, pad=pad)
    planes = 1 if len(tail) == 1 else 2
    kv = torch.randn(3, planes, 40, 4, *tail).to(dtype)
    kv_ref, kv_tri = kv.clone(), kv.clone()
    want = accept_path_ref(kv_ref, slot_mapping, vr, path, accepted, next_tokens, tokens, samples)
    got = accept_path_triton(kv_tri, slot_mapping, vr, path, accepted, next_tokens, tokens, samples)
    for w, o in zip(want, got):
        assert torch.equal(w, o)
    assert torch.equal(kv_ref, kv_tri)
    cols = torch.arange(1, depth + 1)
    moved = (path[: B - pad, 1:] != cols) & (cols <= accepted[: B - pad, None])
    assert accepted.max() > 0 and moved.any() == (not torch.equal(kv_ref, kv))  # KV moved exactly where nodes did


def test_reference_moves_the_path_and_permutes_its_rows():
    # one request: root row 0, nodes 1..4 in rows 1..4; root -> {1, 2}; 2 -> {3}; 3 -> {4}; accepted path 0, 2, 3
    vr = torch.arange(5)[None, :]
    path, accepted = torch.tensor([[0, 2, 3, 3]]), torch.tensor([2])
    slot_mapping = torch.tensor([10, 11, 12, 13, 14])
    kv = torch.arange(1 * 1 * 4 * 8, dtype=torch.float32).view(1, 1, 4, 8, 1)  # slot s holds the value s
    tokens = torch.tensor([[7, 8, 9, -1]])
    for samples in (torch.tensor([False]), torch.tensor([True])):
        cache = kv.clone()
        out = accept_path_ref(cache, slot_mapping, vr, path, accepted, torch.arange(5) + 50, tokens, samples)
        assert cache.flatten()[10:15].tolist() == [10, 12, 13, 13, 14]  # slots 11, 12 took nodes 2's and 3's KV
        assert out.perm.tolist() == [0, 2, 3, 3, 4] and out.out_rows.tolist() == [2]
        want_next = [7, 8, 9, 53, 54] if samples.item() else [50, 51, 52, 53, 54]
        assert out.next_tokens.tolist() == want_next


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_on_a_gpu_the_kernel_equals_the_cpu_reference(dtype):
    from kernels.tree_accept import accept_path

    slot_mapping, vr, path, accepted, next_tokens, tokens, samples = _step(16, 16, 8, seed=9, pad=3, blocks=80)
    kv = torch.randn(30, 2, 80, 4, 3, 64).to(dtype)  # SmolLM2's layers, heads and head dim: 12 programs a request
    kv_ref = kv.clone()
    want = accept_path_ref(kv_ref, slot_mapping, vr, path, accepted, next_tokens, tokens, samples)
    kv_gpu = kv.cuda()
    got = accept_path(kv_gpu, *(t.cuda() for t in (slot_mapping, vr, path, accepted, next_tokens, tokens, samples)))
    for w, o in zip(want, got):
        assert torch.equal(w, o.cpu())
    assert torch.equal(kv_ref, kv_gpu.cpu())
