"""kernels/tree_rows.py: a draft tree's verification rows (the trees read by slot, node positions, tree masks), the
Triton kernel (interpreted here) equal to its torch reference, and the reference's masks equal to the ancestor sets
they encode."""
import pytest
import torch

from kernels.tree_mask import ancestor_bits
from kernels.tree_rows import tree_rows_ref, tree_rows_triton
from tests.support.draft_trees import random_parents


def _tables(S: int, N: int, g: torch.Generator):
    """S random trees of N nodes in depth order (each node after its parent), as TreeSlots holds them."""
    parents = random_parents(S, N, N, g)
    depth = torch.zeros((S, N + 1), dtype=torch.int64)
    for j in range(N):
        depth[:, j + 1] = depth.gather(1, parents[:, j: j + 1])[:, 0] + 1
    cells = torch.randint(-1, 200, (S, N), generator=g)
    return parents, depth, ancestor_bits(parents), cells


def _batch(B: int, N: int, prompt_rows: int, seed: int):
    """B decoding requests of N + 1 rows each (a request with fewer nodes repeats its last row), after a prefilling
    request's prompt rows, in a step whose KV lengths run past the nodes (a graph's padded layout)."""
    g = torch.Generator().manual_seed(seed)
    S = B + 3
    tabs = _tables(S, N, g)
    slots = torch.randperm(S, generator=g)[:B]
    num = torch.randint(0, N + 1, (B,), generator=g)
    num[0] = N
    col = torch.minimum(torch.arange(N + 1)[None, :], num[:, None])
    vr = prompt_rows + torch.arange(B)[:, None] * (N + 1) + col
    T = prompt_rows + B * (N + 1)
    positions = torch.arange(T) + 100  # each request's rows as a chain's: root at start, node j at start + j
    root = positions[vr[:, 0]]
    seq_lens = (root + N + 1 + torch.randint(0, max(1, 64 - N - 1), (B,), generator=g)).to(torch.int32)
    return vr, num, slots, tabs, positions, seq_lens


@pytest.mark.parametrize("B,N,prompt_rows", [(1, 8, 0), (3, 8, 5), (4, 3, 0), (2, 16, 2), (3, 32, 0), (2, 1, 0)])
def test_triton_equals_reference(B, N, prompt_rows):
    vr, num, slots, tabs, positions, seq_lens = _batch(B, N, prompt_rows, seed=B * 100 + N)
    want = tree_rows_ref(vr, num, slots, *tabs, positions, seq_lens)
    got = tree_rows_triton(vr, num, slots, *tabs, positions, seq_lens)
    for w, o in zip(want, got):
        assert torch.equal(w, o)


def test_reference_places_nodes_at_their_depth_and_masks_by_ancestry():
    vr, num, slots, tabs, positions, seq_lens = _batch(2, 8, 3, seed=7)
    out = tree_rows_ref(vr, num, slots, *tabs, positions, seq_lens)
    assert torch.equal(out.parents, tabs[0][slots]) and torch.equal(out.cells, tabs[3][slots])
    for b in range(2):
        root_row = int(vr[b, 0])
        root, end = int(positions[root_row]), int(seq_lens[b])
        assert out.masks[root_row] == -1 and out.positions[root_row] == root
        for j in range(1, int(num[b]) + 1):
            row = int(vr[b, j])
            assert out.positions[row] == root + out.depth[b, j]
            for pos in range(end - 64, end):  # bit w of the mask admits position end - 64 + w
                admitted = bool((int(out.masks[row]) >> (pos - end + 64)) & 1)
                i = pos - root  # node i sits at KV position root + i (the chain layout)
                expect = pos < root or (i <= int(num[b]) and bool((int(out.ancestors[b, j]) >> i) & 1))
                assert admitted == expect or i > int(num[b]), (b, j, pos)
    prompt = torch.ones(positions.shape[0], dtype=torch.bool)
    prompt[vr.flatten()] = False
    assert (out.masks[prompt] == -1).all() and torch.equal(out.positions[prompt], positions[prompt])


@pytest.mark.gpu
@pytest.mark.parametrize("B,N", [(1, 8), (16, 16), (64, 63)])
def test_on_a_gpu_the_kernel_equals_the_cpu_reference(B, N):
    from kernels.tree_rows import tree_rows

    vr, num, slots, tabs, positions, seq_lens = _batch(B, N, 3, seed=N)
    want = tree_rows_ref(vr, num, slots, *tabs, positions, seq_lens)
    got = tree_rows(vr.cuda(), num.cuda(), slots.cuda(), *(t.cuda() for t in tabs), positions.cuda(), seq_lens.cuda())
    for w, o in zip(want, got):
        assert torch.equal(w, o.cpu())


@pytest.mark.parametrize("N,with_cells", [(8, True), (16, False), (63, True)])
def test_stored_trees_read_back(N, with_cells):
    """store_trees (kernel, interpreted, and reference) writes each tree into its slot's rows and nothing else; the
    rows read back by tree_rows are the trees stored."""
    from kernels.tree_rows import store_trees_ref, store_trees_triton

    g = torch.Generator().manual_seed(N)
    S, B = 7, 3
    trees = _tables(B, N, g)
    slots = torch.tensor([5, 0, 3])
    for store in (store_trees_ref, store_trees_triton):
        tabs = _tables(S, N, torch.Generator().manual_seed(99))
        before = [t.clone() for t in tabs]
        store(slots, *trees[:3], trees[3] if with_cells else None, *tabs)
        want_cells = trees[3] if with_cells else torch.full_like(trees[0], -1)
        for tab, old, new in zip(tabs, before, (*trees[:3], want_cells)):
            assert torch.equal(tab[slots], new), store.__name__
            keep = [s for s in range(S) if s not in slots.tolist()]
            assert torch.equal(tab[keep], old[keep]), store.__name__
