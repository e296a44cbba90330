"""kernels/draft_layout.py: the rows of a step's draft passes (chains at width 1, tree frontiers at width topk), the
Triton kernel (interpreted here) equal to its torch reference, and the reference equal to the rule it states."""
import pytest
import torch

from kernels.draft_layout import draft_layout_ref, draft_layout_triton


def _case(B: int, M: int, block_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tables = torch.randperm(B * M + 7, generator=g)[: B * M].view(B, M).to(torch.int32)
    first = torch.randint(1, M * block_size, (B,), generator=g)
    # some requests hold every slot they reach, some stop short (their last rows are dropped), one holds none past first
    limit = first + torch.randint(0, 3 * block_size, (B,), generator=g)
    limit[0] = first[0]
    return tables, first, limit


@pytest.mark.parametrize("B,M,block_size,passes,width", [
    (1, 4, 16, 2, 1), (3, 5, 16, 7, 1), (4, 6, 16, 2, 4), (2, 8, 8, 3, 8), (5, 3, 16, 7, 2), (2, 4, 16, 1, 3)])
def test_triton_equals_reference(B, M, block_size, passes, width):
    tables, first, limit = _case(B, M, block_size, seed=B * 100 + passes * 10 + width)
    want = draft_layout_ref(tables, first, limit, block_size, passes, width)
    got = draft_layout_triton(tables, first, limit, block_size, passes, width)
    for w, o in zip(want, got):
        assert w.dtype == o.dtype and torch.equal(w, o)
    if B > 1:  # dropped rows and kept rows both exercised
        assert (want.slots < 0).any() and (want.slots >= 0).any()


def test_reference_states_the_rule():
    tables = torch.tensor([[3, 7, 9]], dtype=torch.int32)  # block size 4: positions 0-3 in block 3, 4-7 in 7, ...
    out = draft_layout_ref(tables, torch.tensor([5]), torch.tensor([10]), 4, passes=2, width=3)
    # pass 0 at KV positions 5, 6, 7; pass 1 at 8, 9, 10 (10 is past the 10 slots held: dropped)
    assert out.slots.tolist() == [[7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3], [9 * 4 + 0, 9 * 4 + 1, -1]]
    assert out.positions.tolist() == [[5, 5, 5], [6, 6, 6]]
    assert out.seq_lens.tolist() == [[8], [11]] and out.query_start_loc.tolist() == [0, 3]


@pytest.mark.gpu
@pytest.mark.parametrize("width", [1, 4, 8])
def test_on_a_gpu_the_kernel_equals_the_cpu_reference(width):
    from kernels.draft_layout import draft_layout

    tables, first, limit = _case(64, 6, 16, seed=width)
    want = draft_layout_ref(tables, first, limit, 16, 7, width)
    got = draft_layout(tables.cuda(), first.cuda(), limit.cuda(), 16, 7, width)
    for w, o in zip(want, got):
        assert torch.equal(w, o.cpu())
