"""Tree masks for paged attention (kernels/attention.py `tree_mask`): which of its request's last 64 KV positions a
query row may attend to. Speculation's draft trees put several candidate continuations side by side in the KV
of one request; a node must see the prefix and its own ancestors, never a sibling's branch.

A row's mask is one int64: bit w admits KV position seq_len - 64 + w (still only causally); positions before
seq_len - 64 are never refused by it. All bits set (-1) is plain causal attention, so prefill rows and chains
carry -1 and a lower-triangular tree (a chain) gives the same result as no mask. 64 bits bound a tree: its
nodes and the prefix rows after them fit in the window (engine/config.py checks the sizes).

Trees here are written as ancestor sets over a span of consecutive positions: bit j of `ancestors` is position
(seq_len - span + j), the node itself included.
"""
import torch

WINDOW = 64  # positions one mask speaks of


def window_bits(ancestors: torch.Tensor, span: torch.Tensor | int) -> torch.Tensor:
    """ancestors [...] int64 over the last `span` (1..64, broadcastable) positions -> the masks [...] int64 over the
    last 64: the positions before the span (the prefix) all admitted."""
    if isinstance(span, int):
        # A Python span stays a scalar: as a tensor it would be a host-to-device copy, which a CUDA graph's
        # capture refuses (the draft tree's frontier passes run inside the captured step).
        below = WINDOW - span
        return torch.bitwise_left_shift(ancestors, below) | ((1 << below) - 1)  # 2**63 - 1 at below = 63, as below
    span = torch.as_tensor(span, dtype=torch.int64, device=ancestors.device)
    below = WINDOW - span  # prefix positions inside the window
    one = torch.ones_like(below)
    prefix = torch.bitwise_left_shift(one, below) - 1  # wraps to all-but-the-top bit at below = 63, as meant
    return prefix | torch.bitwise_left_shift(ancestors, below)


def ancestor_bits(parents: torch.Tensor, max_depth: int | None = None) -> torch.Tensor:
    """parents [B, N] int64: node j+1's parent among nodes 0..j (node 0 is the root, the request's verified token)
    -> [B, N+1] int64 ancestor sets over the nodes (bit i: node i; the node itself included). max_depth: a bound on
    the nodes' depth (default N).
    Pointer doubling: after round t each node holds its ancestors up to 2**t - 1 levels up and points 2**t up, so
    log2(depth) rounds of two gathers and an or, not a gather, an or and a stack per node (a draft tree is expanded
    inside the captured decode step, where each op is a graph node its launch pays for)."""
    B, N = parents.shape
    dev = parents.device
    up = torch.cat([torch.zeros((B, 1), dtype=torch.int64, device=dev), parents], 1)  # the root points to itself
    node = torch.arange(N + 1, device=dev)
    bits = torch.bitwise_left_shift(torch.ones_like(node), node).expand(B, N + 1)  # bit 63 wraps to the sign bit
    rounds = max(1, (N if max_depth is None else min(max_depth, N)).bit_length())
    for r in range(rounds):
        bits = bits | bits.gather(1, up)
        if r + 1 < rounds:
            up = up.gather(1, up)
    return bits


def chain_bits(n: int, device=None) -> torch.Tensor:
    """A chain of n nodes (each the parent of the next) as ancestor sets [n] int64: lower-triangular."""
    return (torch.bitwise_left_shift(torch.ones(n, dtype=torch.int64, device=device),
                                     torch.arange(1, n + 1, device=device)) - 1)
