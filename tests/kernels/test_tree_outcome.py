"""kernels/tree_outcome.py: a verified tree's reached/accepted nodes and the acceptance table's update, the Triton
kernels (interpreted here) equal to their torch references, on random trees and paths walked down them."""
import pytest
import torch

from kernels.tree_outcome import log_estimates, observe_ref, observe_triton, outcome_ref, outcome_triton
from kernels.tree_walk import walk_ref
from tests.support.draft_trees import follow_a_branch, random_parents


def _verified(B: int, N: int, depth: int, seed: int):
    """Random depth-ordered trees, target tokens that follow a random branch, and the walk's path down them."""
    g = torch.Generator().manual_seed(seed)
    parents = random_parents(B, N, depth, g)
    drafts = torch.arange(N)[None, :].expand(B, N) + 10  # distinct tokens: node j+1 holds 10 + j
    target = follow_a_branch(parents, drafts, depth, g)
    num = torch.randint(1, N + 1, (B,), generator=g)
    num[0] = N
    path, _, _ = walk_ref(target, drafts, parents, num, depth)
    return path, parents, num, g


@pytest.mark.parametrize("B,N,depth", [(1, 8, 3), (4, 8, 4), (3, 16, 8), (5, 3, 3), (2, 63, 8)])
def test_outcome_triton_equals_reference(B, N, depth):
    path, parents, num, _ = _verified(B, N, depth, seed=B * 100 + N + depth)
    want, got = outcome_ref(path, parents, num), outcome_triton(path, parents, num)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert want[0].any() and (want[0] & ~want[1]).any()  # reached nodes, accepted and rejected ones


@pytest.mark.parametrize("rows,N,K,steps", [(1, 8, 4, 3), (6, 16, 8, 2), (40, 32, 8, 1)])
def test_observe_triton_equals_reference(rows, N, K, steps):
    """Several steps in a row (the decay then acts on counts near the cap), cells repeated within a step."""
    g = torch.Generator().manual_seed(rows + N)
    C = 4 * K * 16
    trials = torch.full((C,), 8.0) + torch.randint(0, 600, (C,), generator=g).float()
    hits = trials * torch.rand(C, generator=g)
    want_t, want_h, got_t, got_h = trials.clone(), hits.clone(), trials.clone(), hits.clone()
    want_r, got_r = log_estimates(trials, hits), log_estimates(trials, hits)
    for _ in range(steps):
        cells = torch.randint(-1, 12, (rows, N), generator=g)  # few cells: many repeats within one launch
        reached = torch.rand((rows, N), generator=g) < 0.7
        accepted = reached & (torch.rand((rows, N), generator=g) < 0.5)
        observe_ref(want_t, want_h, want_r, cells, reached, accepted, 512.0)
        observe_triton(got_t, got_h, got_r, cells, reached, accepted, 512.0)
    torch.testing.assert_close(got_t, want_t, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_h, want_h, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_r, want_r, rtol=1e-6, atol=1e-6)
    assert torch.equal(want_r, log_estimates(want_t, want_h))  # the log-rates follow the counts
    assert (want_t <= 512.0 + 1e-3).all() and not torch.equal(want_t, trials)


def test_outcome_reference_on_a_known_tree():
    # root -> {1, 2}; 1 -> {3}; 3 -> {4}; the path accepted 1 then 3, then stopped
    parents = torch.tensor([[0, 0, 1, 3]])
    path = torch.tensor([[0, 1, 3, 3]])
    reached, accepted = outcome_ref(path, parents, torch.tensor([4]))
    assert reached.tolist() == [[True, True, True, True]] and accepted.tolist() == [[True, False, True, False]]
    reached, accepted = outcome_ref(path, parents, torch.tensor([2]))  # the tree cut to its first two nodes
    assert reached.tolist() == [[True, True, False, False]] and accepted.tolist() == [[True, False, False, False]]


@pytest.mark.gpu
def test_on_a_gpu_both_kernels_equal_the_cpu_references():
    """The table's update under atomics from many requests at once (a padded batch of 64), three steps in a row."""
    from kernels.tree_outcome import observe, outcome

    path, parents, num, g = _verified(64, 16, 8, seed=3)
    want, got = outcome_ref(path, parents, num), outcome(path.cuda(), parents.cuda(), num.cuda())
    assert torch.equal(want[0], got[0].cpu()) and torch.equal(want[1], got[1].cpu())
    C = 4 * 8 * 16
    trials = torch.full((C,), 8.0) + torch.randint(0, 600, (C,), generator=g).float()
    hits = trials * torch.rand(C, generator=g)
    ref = [trials.clone(), hits.clone(), log_estimates(trials, hits)]
    dev = [t.cuda() for t in ref]
    for _ in range(3):
        cells = torch.randint(-1, 40, (64, 16), generator=g)
        reached = torch.rand((64, 16), generator=g) < 0.7
        accepted = reached & (torch.rand((64, 16), generator=g) < 0.5)
        observe_ref(*ref, cells, reached, accepted, 512.0)
        observe(*dev, cells.cuda(), reached.cuda(), accepted.cuda(), 512.0)
    for r, d in zip(ref, dev):
        torch.testing.assert_close(d.cpu(), r, rtol=1e-5, atol=1e-5)
