"""kernels/tree_walk.py: the walk down a verified draft tree, the Triton kernel (interpreted here) equal to its torch
reference on random trees, trees cut short (num_drafts < N), depth bounds and rejections at every depth."""
import pytest
import torch

from kernels.tree_walk import walk_ref, walk_triton
from tests.support.draft_trees import follow_a_branch, random_parents


def _trees(B: int, N: int, depth: int, seed: int):
    """Random trees in depth order (each node after its parent, at most `depth` deep), siblings with distinct
    tokens (non-siblings may share one), and target tokens that follow a random branch for a random number of steps,
    then disagree."""
    g = torch.Generator().manual_seed(seed)
    parents = random_parents(B, N, depth, g)
    drafts = torch.zeros(B, N, dtype=torch.int64)
    for b in range(B):
        for j in range(N):
            p = int(parents[b, j])
            drafts[b, j] = 10 * p + int((parents[b, :j] == p).sum())  # distinct among siblings
    target = follow_a_branch(parents, drafts, depth, g)
    num = torch.randint(1, N + 1, (B,), generator=g)
    num[0] = N
    return target, drafts, parents, num


@pytest.mark.parametrize("B,N,depth", [(4, 3, 3), (5, 8, 3), (6, 16, 4), (3, 8, 8), (4, 63, 8), (2, 1, 1)])
def test_triton_equals_reference(B, N, depth):
    target, drafts, parents, num = _trees(B, N, depth, seed=B * 1000 + N * 10 + depth)
    want = walk_ref(target, drafts, parents, num, depth)
    got = walk_triton(target, drafts, parents, num, depth)
    assert all(torch.equal(w, g_) for w, g_ in zip(want, got))
    assert got[1].max() > 0  # some request accepted drafts: the cases exercise the walk


def test_reference_follows_the_matching_child_and_stops():
    # root -> {1: 5, 2: 6}; 1 -> {3: 7}; 2 -> {4: 8}; 3 -> {5: 9}
    drafts = torch.tensor([[5, 6, 7, 8, 9]] * 2)
    parents = torch.tensor([[0, 0, 1, 2, 3]] * 2)
    target = torch.tensor([[6, 0, 8, 0, 1, 0], [5, 7, 0, 9, 0, 4]])
    for fn in (walk_ref, walk_triton):
        path, accepted, tokens = fn(target, drafts, parents, torch.tensor([5, 5]), 3)
        assert accepted.tolist() == [2, 3] and path.tolist() == [[0, 2, 4, 4], [0, 1, 3, 5]]
        assert tokens.tolist() == [[6, 8, 1, -1], [5, 7, 9, 4]]  # the accepted drafts, the bonus, -1 past them
        path, accepted, tokens = fn(target, drafts, parents, torch.tensor([5, 2]), 3)  # the second tree cut to 2 nodes
        assert accepted.tolist() == [2, 1] and tokens.tolist() == [[6, 8, 1, -1], [5, 7, -1, -1]]
