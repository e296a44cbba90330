"""Turns a scheduler decision into the flat tensors one forward needs.

All indexing is done here, on the host, with numpy; the forward then sees only fixed-layout tensors
(no host syncs inside it). Rows of the varlen batch are requests in scheduling order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.block_manager import BlockManager
from engine.sampler import SamplingBatch
from engine.scheduler import ScheduledRequest


@dataclass(frozen=True, slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: rows of T whose hidden state is sampled
    sampling: SamplingBatch | None  # None when no request samples this step
    sample_rows: list[int]  # index into the scheduled list for each of the N sampled rows


def build_inputs(scheduled: list[ScheduledRequest], blocks: BlockManager, kv_cache: torch.Tensor,
                 device: torch.device, vocab_size: int) -> ModelInputs:
    bs = blocks.block_size
    num_tokens = sum(s.num_new_tokens for s in scheduled)
    input_ids = np.empty(num_tokens, dtype=np.int64)
    positions = np.empty(num_tokens, dtype=np.int64)
    slot_mapping = np.empty(num_tokens, dtype=np.int64)
    query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int32)
    seq_lens = np.empty(len(scheduled), dtype=np.int32)
    max_blocks = max(len(blocks.table(s.request.request_id)) for s in scheduled)
    block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
    logits_indices: list[int] = []
    sample_rows: list[int] = []

    t = 0
    for b, s in enumerate(scheduled):
        req, n = s.request, s.num_new_tokens
        start = req.num_computed_tokens
        table = blocks.table(req.request_id)
        block_tables[b, : len(table)] = table
        pos = np.arange(start, start + n, dtype=np.int64)
        input_ids[t : t + n] = req.token_ids[start : start + n]
        positions[t : t + n] = pos
        slot_mapping[t : t + n] = block_tables[b, pos // bs].astype(np.int64) * bs + pos % bs
        t += n
        query_start_loc[b + 1] = t
        seq_lens[b] = start + n
        if s.sample:
            logits_indices.append(t - 1)
            sample_rows.append(b)

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    q_lens = np.diff(query_start_loc)
    attn = AttentionMetadata(
        kv_cache=kv_cache,
        slot_mapping=dev(slot_mapping),
        block_tables=dev(block_tables),
        seq_lens=dev(seq_lens),
        query_start_loc=dev(query_start_loc),
        max_q_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    sampled = [scheduled[b] for b in sample_rows]
    sampling = build_sampling(sampled, device, vocab_size) if sampled else None
    return ModelInputs(dev(input_ids), dev(positions), attn, dev(np.asarray(logits_indices, dtype=np.int64)),
                       sampling, sample_rows)


def build_sampling(sampled: list[ScheduledRequest], device: torch.device, vocab_size: int) -> SamplingBatch:
    reqs = [s.request for s in sampled]
    params = [r.params for r in reqs]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)
    seeds = torch.tensor([r.seed for r in reqs], dtype=torch.int64)
    # The token being sampled sits right after everything computed so far.
    positions = torch.tensor([s.request.num_computed_tokens + s.num_new_tokens for s in sampled], dtype=torch.int64)
    asked = [p.logprobs for p in params if p.logprobs is not None]
    sampling_rows = [p for p in params if not p.greedy]
    penalties = {}
    if any(p.uses_penalties for p in params):
        penalties = _penalty_tensors(reqs, vocab_size)
    return SamplingBatch(
        temperature=temperature.to(device), top_k=top_k.to(device), top_p=top_p.to(device),
        min_p=min_p.to(device), seeds=seeds.to(device), positions=positions.to(device),
        all_greedy=not sampling_rows,
        use_top_k=any(0 < p.top_k < vocab_size for p in sampling_rows),
        use_top_p=any(p.top_p < 1.0 for p in sampling_rows),
        use_min_p=any(p.min_p > 0.0 for p in sampling_rows),
        max_logprobs=max(asked) if asked else None,
        **{k: v.to(device) for k, v in penalties.items()},
    )


def _penalty_tensors(reqs, vocab_size: int) -> dict[str, torch.Tensor]:
    n = len(reqs)
    counts = torch.zeros(n, vocab_size, dtype=torch.float32)
    seen = torch.zeros(n, vocab_size, dtype=torch.bool)
    for i, r in enumerate(reqs):
        out = torch.tensor(r.output_token_ids, dtype=torch.int64)
        if out.numel():
            counts[i].scatter_add_(0, out, torch.ones(out.numel()))
        seen[i, torch.tensor(r.token_ids, dtype=torch.int64)] = True
    return {
        "repetition": torch.tensor([r.params.repetition_penalty for r in reqs], dtype=torch.float32),
        "presence": torch.tensor([r.params.presence_penalty for r in reqs], dtype=torch.float32),
        "frequency": torch.tensor([r.params.frequency_penalty for r in reqs], dtype=torch.float32),
        "output_counts": counts,
        "seen_mask": seen,
    }
