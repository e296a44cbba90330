"""decode_worker/group.py rank_kv_heads: which of the model's KV heads each decode rank holds, and so receives in
a hand-over. Under TP a K/V cache is sliced by heads; MLA's latent is one head TP cannot slice, so every rank holds
(and gets) it whole; under attention data parallelism a rank holds every head of its own requests."""
from __future__ import annotations

import pytest

from cluster.protocol import KVLayout
from decode_worker.group import rank_kv_heads


def layout(planes: int, heads: int, head_dim: int, replicated: bool) -> KVLayout:
    return KVLayout(num_layers=3, planes=planes, num_kv_heads=heads, head_dim=head_dim, replicated=replicated,
                    block_size=16, dtype="float32")


LLAMA = layout(2, 4, 16, False)
ONE_KV_HEAD = layout(2, 1, 64, False)  # a Llama with fewer KV heads than ranks: kv_head_slice replicates it
MLA = layout(1, 1, 40, True)  # kv_lora_rank 32 + qk_rope_head_dim 8


@pytest.mark.parametrize("lay, tp, adp, want", [
    (LLAMA, 2, False, [(0, 2), (2, 2)]),
    (LLAMA, 4, False, [(0, 1), (1, 1), (2, 1), (3, 1)]),
    (LLAMA, 2, True, [(0, 4), (0, 4)]),
    (ONE_KV_HEAD, 2, False, [(0, 1), (0, 1)]),
    (MLA, 2, False, [(0, 1), (0, 1)]),
    (MLA, 4, False, [(0, 1)] * 4),
    (MLA, 2, True, [(0, 1), (0, 1)]),
])
def test_each_rank_holds_its_heads(lay, tp, adp, want):
    assert [rank_kv_heads(lay, tp, r, adp) for r in range(tp)] == want


def test_a_replicated_layout_never_consults_the_slicing_rule():
    """3 latent "heads" on 2 ranks do not divide (kv_head_slice would refuse): replicated, each rank holds all."""
    wide = layout(1, 3, 40, True)
    assert [rank_kv_heads(wide, 2, r, False) for r in range(2)] == [(0, 3), (0, 3)]
    with pytest.raises(ValueError, match="do not divide"):
        rank_kv_heads(layout(2, 3, 16, False), 2, 0, False)
