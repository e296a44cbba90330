"""bench/tree_ops.py: what counts as a kernel launch (no model: the counter itself)."""
import torch

from bench.tree_ops import KernelCount, table
from kernels.tree_expand import expand_depth_triton


def test_views_allocations_and_no_op_copies_launch_nothing():
    x = torch.randn(4, 4)
    with KernelCount() as c:
        x.view(16), x.t(), x[1:], torch.empty(3), x.to(torch.float32), x.contiguous()
        x + 1
        x.add_(1)
        x.to(torch.float64)
        x.t().contiguous()
    assert dict(c.calls) == {"add": 1, "add_": 1, "_to_copy": 1, "clone": 1}
    assert c.total == 4


def test_a_triton_launch_counts_once_and_the_interpreters_own_ops_not_at_all():
    B, R, K = 2, 1, 4
    lp, ids = torch.randn(B, R, 10).log_softmax(-1).topk(K, dim=-1)
    masked, sampled = torch.zeros(B, R, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
    with KernelCount() as c:
        expand_depth_triton(lp, ids, None, None, masked, sampled, None, 16, None, None, None, 0, 0, 4)
    assert dict(c.calls) == {"triton:_expand_depth_kernel": 1}


def test_a_count_inside_a_count_leaves_the_outer_one_whole():
    """A step's count holds its expansion's, which bench.tree_ops also counts on its own: the Triton launches as
    well as the aten calls (the expansion's launches were once missing from the step's count)."""
    B, R, K = 2, 1, 4
    lp, ids = torch.randn(B, R, 10).log_softmax(-1).topk(K, dim=-1)
    masked, sampled = torch.zeros(B, R, dtype=torch.bool), torch.zeros(B, dtype=torch.bool)
    with KernelCount() as outer:
        lp.exp()
        with KernelCount() as inner:
            expand_depth_triton(lp, ids, None, None, masked, sampled, None, 16, None, None, None, 0, 0, 4)
            lp.neg()
    assert dict(inner.calls) == {"triton:_expand_depth_kernel": 1, "neg": 1}
    assert dict(outer.calls) == {"triton:_expand_depth_kernel": 1, "neg": 1, "exp": 1}


def test_table_reads_against_the_chain_of_3():
    rows = [dict(topk=1, depth=0, verified_nodes=0, step_kernels=400, expansion_kernels=0),
            dict(topk=1, depth=3, verified_nodes=3, step_kernels=500, expansion_kernels=0),
            dict(topk=4, depth=3, verified_nodes=8, step_kernels=600, expansion_kernels=100)]
    text = table(rows)
    assert "| chain k=3 | 3 | 500 | - | 1.00x |" in text and "| tree topk=4 depth=3 | 8 | 600 | 100 | 1.20x |" in text
    assert "| no speculation | 0 | 400 | - | 0.80x |" in text


def test_table_shows_the_gpu_profilers_count_beside_the_dispatch_count():
    rows = [dict(topk=1, depth=3, verified_nodes=3, step_kernels=500, expansion_kernels=0, gpu_profiled_kernels=540),
            dict(topk=4, depth=3, verified_nodes=8, step_kernels=490, expansion_kernels=60, gpu_profiled_kernels=530)]
    text = table(rows)
    assert "CUDA profiler's kernels per step" in text and "| chain k=3 | 3 | 500 | - | 1.00x | 540 |" in text
    assert "profiler" not in table([dict(r, gpu_profiled_kernels=None) for r in rows])  # a CPU run: no column
