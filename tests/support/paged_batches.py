"""Paged batches for the attention kernels' tests (tests/kernels, and the engine tests that call the kernels):
dense KV and latent (MLA) caches with blocks in random order, and random draft trees with the positions each of
their rows may see."""
from __future__ import annotations

import random

import torch

from kernels.tree_mask import ancestor_bits, window_bits

TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def paged_batch(q_lens, seq_lens, Hq, Hkv, D, page, dtype, pad_rows=0, device="cpu", seed=0):
    """A paged batch with blocks in random order, unused slots holding NaN, and T padded by pad_rows."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    B = len(q_lens)
    need = [-(-s // page) for s in seq_lens]
    max_blocks = max(need + [1]) + 1
    N = sum(need) + 3
    ids = list(range(N))
    rnd.shuffle(ids)
    k_cache = torch.full((N, page, Hkv, D), float("nan"), dtype=dtype)
    v_cache = torch.full((N, page, Hkv, D), float("nan"), dtype=dtype)
    block_tables = torch.zeros((B, max_blocks), dtype=torch.int32)
    dense_k, dense_v = [], []
    for b, s in enumerate(seq_lens):
        blocks = [ids.pop() for _ in range(need[b])]
        block_tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        k = torch.randn(s, Hkv, D, generator=gen).to(dtype)
        v = torch.randn(s, Hkv, D, generator=gen).to(dtype)
        for p in range(s):
            k_cache[blocks[p // page], p % page] = k[p]
            v_cache[blocks[p // page], p % page] = v[p]
        dense_k.append(k)
        dense_v.append(v)
    T = sum(q_lens) + pad_rows
    query = torch.randn(T, Hq, D, generator=gen).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    t = lambda x: x.to(device)
    return dict(
        query=t(query), k_cache=t(k_cache), v_cache=t(v_cache), block_tables=t(block_tables),
        seq_lens=t(torch.tensor(seq_lens, dtype=torch.int32)), query_start_loc=t(qsl),
    ), dense_k, dense_v


def latent_batch(q_lens, seq_lens, H, L, R, page, dtype, pad_rows=0, seed=0, device="cpu"):
    """A latent paged batch with blocks in random order, unused slots holding NaN, T padded by pad_rows."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    B = len(q_lens)
    need = [-(-s // page) for s in seq_lens]
    N = sum(need) + 3
    ids = list(range(N))
    rnd.shuffle(ids)
    cache = torch.full((N, page, L + R), float("nan"), dtype=dtype)
    block_tables = torch.zeros((B, max(need + [1]) + 1), dtype=torch.int32)
    dense = []
    for b, s in enumerate(seq_lens):
        blocks = [ids.pop() for _ in range(need[b])]
        block_tables[b, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        rows = torch.randn(s, L + R, generator=gen).to(dtype)
        for p in range(s):
            cache[blocks[p // page], p % page] = rows[p]
        dense.append(rows)
    T = sum(q_lens) + pad_rows
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    batch = dict(q_latent=torch.randn(T, H, L, generator=gen).to(dtype), q_rope=torch.randn(T, H, R, generator=gen).to(dtype),
                 latent_cache=cache, block_tables=block_tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                 query_start_loc=qsl)
    return {k: v.to(device) for k, v in batch.items()}, dense


def random_parents(n: int, rnd: random.Random) -> list[int]:
    """Node j+1's parent among nodes 0..j (0: the root)."""
    return [rnd.randrange(0, j + 1) for j in range(n)]


def tree_case(q_lens, seq_lens, seed, prefill_rows: bool = True):
    """Each request's new rows are a random tree (row 0 its root), or (q_len > 40) a prefill chunk with mask -1.
    -> (tree_mask [T] int64, allowed [n, s] per request)."""
    rnd = random.Random(seed)
    masks, allowed = [], []
    for n, s in zip(q_lens, seq_lens):
        if n == 0:
            allowed.append(torch.zeros(0, s, dtype=torch.bool))
            continue
        causal = torch.arange(s)[None, :] <= (s - n + torch.arange(n))[:, None]
        if n > 40 and prefill_rows:
            masks.append(torch.full((n,), -1, dtype=torch.int64))
            allowed.append(causal)
            continue
        parents = torch.tensor([random_parents(n - 1, rnd)], dtype=torch.int64)
        anc = ancestor_bits(parents)[0]  # [n] over the request's n new rows
        masks.append(window_bits(anc, n))
        sees = causal.clone()
        for i in range(n):
            for j in range(n):
                sees[i, s - n + j] = bool((int(anc[i]) >> j) & 1)
        allowed.append(sees)
    return torch.cat(masks) if masks else torch.zeros(0, dtype=torch.int64), allowed


# (q_lens, seq_lens) of tree-masked batches: one tree, trees beside a decode row and an empty request, a tree with
# no prefix before it (shorter than the 64-position window), trees of up to 63 drafts spanning more than one query
# tile, prompt chunks (q_len > 40: mask -1) alone and beside trees.
TREE_CASES = [
    ([5], [40]),
    ([4, 1, 0, 9], [100, 17, 0, 9]),
    ([3], [3]),
    ([17, 33], [90, 70]),
    ([64], [200]),
    ([2, 50, 6], [30, 50, 81]),
]
