"""Random draft trees for the tree kernels' tests (tests/kernels/test_tree_*.py): nodes in depth order, and target
tokens that follow one branch down for a while, then disagree (what verification's walk sees)."""
from __future__ import annotations

import torch


def random_parents(B: int, N: int, depth: int, g: torch.Generator) -> torch.Tensor:
    """[B, N] int64: node j+1's parent among nodes 0..j (0: the root), no node deeper than `depth`."""
    parents = torch.zeros((B, N), dtype=torch.int64)
    for b in range(B):
        depth_of = [0]
        for j in range(N):
            choices = [p for p in range(j + 1) if depth_of[p] < depth]
            p = choices[int(torch.randint(len(choices), (1,), generator=g))]
            parents[b, j] = p
            depth_of.append(depth_of[p] + 1)
    return parents


def follow_a_branch(parents: torch.Tensor, drafts: torch.Tensor, depth: int, g: torch.Generator,
                    root_accepts: bool = False) -> torch.Tensor:
    """[B, N+1] target tokens: from the root, a random child's draft for a random number of steps (at least one with
    root_accepts, where the root has children), then tokens no draft holds (a rejection)."""
    B, N = parents.shape
    target = torch.randint(1000, 2000, (B, N + 1), generator=g)  # drafts in the tests stay below 1000
    for b in range(B):
        node = 0
        steps = int(torch.randint(depth + 1, (1,), generator=g))
        for step in range(depth):
            kids = [j + 1 for j in range(N) if parents[b, j] == node]
            if not kids or (step >= steps and not (root_accepts and node == 0)):
                break
            child = kids[int(torch.randint(len(kids), (1,), generator=g))]
            target[b, node] = drafts[b, child - 1]
            node = child
    return target
