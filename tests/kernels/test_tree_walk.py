"""kernels/tree_walk.py: the walk down a verified draft tree, the Triton kernel (interpreted here) equal to its torch
reference on random trees, trees cut short (num_drafts < N), depth bounds and rejections at every depth."""
import pytest
import torch

from kernels.tree_walk import walk_ref, walk_triton


def _trees(B: int, N: int, depth: int, seed: int):
    """Random trees in depth order (each node after its parent, at most `depth` deep), siblings with distinct
    tokens, and target tokens that follow a random branch for a random number of steps, then disagree."""
    g = torch.Generator().manual_seed(seed)
    parents, drafts = torch.zeros(B, N, dtype=torch.int64), torch.zeros(B, N, dtype=torch.int64)
    target = torch.randint(1000, 2000, (B, N + 1), generator=g)  # tokens no draft holds: a rejection
    for b in range(B):
        depth_of = [0]
        for j in range(N):
            choices = [p for p in range(j + 1) if depth_of[p] < depth]
            p = choices[int(torch.randint(len(choices), (1,), generator=g))]
            parents[b, j], depth_of = p, depth_of + [depth_of[p] + 1]
            drafts[b, j] = 10 * p + sum(1 for i in range(j) if parents[b, i] == p)  # distinct among siblings
        node = 0
        for _ in range(int(torch.randint(depth + 1, (1,), generator=g))):  # accept along a random branch
            kids = [j + 1 for j in range(N) if parents[b, j] == node]
            if not kids:
                break
            child = kids[int(torch.randint(len(kids), (1,), generator=g))]
            target[b, node] = drafts[b, child - 1]
            node = child
    num = torch.randint(1, N + 1, (B,), generator=g)
    num[0] = N
    return target, drafts, parents, num


@pytest.mark.parametrize("B,N,depth", [(4, 3, 3), (5, 8, 3), (6, 16, 4), (3, 8, 8), (4, 63, 8), (2, 1, 1)])
def test_triton_equals_reference(B, N, depth):
    target, drafts, parents, num = _trees(B, N, depth, seed=B * 1000 + N * 10 + depth)
    want = walk_ref(target, drafts, parents, num, depth)
    got = walk_triton(target, drafts, parents, num, depth)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert got[1].max() > 0  # some request accepted drafts: the cases exercise the walk


def test_reference_follows_the_matching_child_and_stops():
    # root -> {1: 5, 2: 6}; 1 -> {3: 7}; 2 -> {4: 8}; 3 -> {5: 9}
    drafts = torch.tensor([[5, 6, 7, 8, 9]] * 2)
    parents = torch.tensor([[0, 0, 1, 2, 3]] * 2)
    target = torch.tensor([[6, 0, 8, 0, 1, 0], [5, 7, 0, 9, 0, 4]])
    for fn in (walk_ref, walk_triton):
        path, accepted = fn(target, drafts, parents, torch.tensor([5, 5]), 3)
        assert accepted.tolist() == [2, 3] and path.tolist() == [[0, 2, 4, 4], [0, 1, 3, 5]]
        path, accepted = fn(target, drafts, parents, torch.tensor([5, 2]), 3)  # the second tree cut to 2 nodes
        assert accepted.tolist() == [2, 1]
