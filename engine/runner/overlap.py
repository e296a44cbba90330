"""Overlapped scheduling (EngineConfig.async_scheduling): step N+1 is planned, built and launched before
the host reads step N's outputs, so the host work between two steps (reading N, the update, stop checks,
detokenizing, the outputs; scheduling and building N+1) runs while the device computes, as in SGLang's
overlap scheduler and vLLM's async scheduling.

What N+1 cannot know on the host is what N emits: its sampled token, its drafts and how many of them
were accepted. So N+1 is planned as if every draft of N is accepted (KV held for that case, positions
counted that way), and a request N samples is "carried": its N+1 inputs (N's new token, then N's next
drafts) are gathered from N's outputs on the device, and its positions, KV slots, lengths and sampling
positions move back by the drafts N rejected, all before N+1's forward and without a host sync
(`carry_inputs`). The host applies N's outputs afterwards, while N+1 runs; KV past what N+1 uses is then
released. A request that N finished (an eos, a stop string) still ran in N+1: those rows are discarded.

Steps run overlapped only where nothing in N+1 depends on N on the host (`carry_blocker`): no grammar
(a mask needs the matcher advanced through N's tokens), no penalties (their counts are built from the
output tokens), no prompt lookup (it drafts from the tokens), no attention data parallelism (its
agreement is a collective of its own), no prefill-only requests (they park after sampling), no draft-head
KV deferred (engine/speculative/deferred_kv.py), nothing to preempt. Otherwise the engine finishes N
first and runs a synchronous step, as without the option.

On a CPU the "device" is the calling thread itself (torch runs eagerly there), so nothing is hidden,
only reordered; the option is for GPUs, where kernel launches return at once. Threads do not help on a
CPU: the eager forward is Python between its ops, and a second Python thread holding the GIL stalls it
(bench/results/overlap_cpu.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.core.request import Request
from engine.core.scheduler import ScheduledRequest
from engine.runner.batch import StepBatch
from engine.runner.staging import to_device


@dataclass(slots=True)
class InFlight:
    """A launched step whose outputs the host has not read yet."""

    scheduled: list[ScheduledRequest]
    prepared: object  # model_runner.PreparedStep
    launched: object  # model_runner.Launched: its device outputs and their host copies
    overlap: bool = True  # stays in flight past the call that launched it (False: read at once)

    def rows(self) -> dict[str, tuple[int, bool, int]]:
        """request id -> (rows, samples, drafts verified): what Scheduler.schedule plans from."""
        drafts = self.prepared.batch.host_num_drafts
        return {s.request.request_id: (s.num_new_tokens, s.sample, drafts[b]) for b, s in enumerate(self.scheduled)}

    def index(self) -> dict[str, int]:
        return {s.request.request_id: b for b, s in enumerate(self.scheduled)}


def carry_blocker(req: Request, drafts_on_host: bool) -> str | None:
    """Why `req` cannot be carried into a step planned before its previous step's outputs are read (None:
    it can). drafts_on_host: the drafter proposes from the tokens on the host (prompt lookup)."""
    p = req.params
    if p.structured_output is not None:
        return "grammar"
    if p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty:
        return "penalties"
    if req.num_output_tokens < p.min_tokens:
        return "min_tokens"  # its early-stop block counts the output tokens, which the carried step has not read
    if req.prefill_only:
        return "prefill-only"
    if drafts_on_host:
        return "prompt lookup"
    if req.draft_holes_from is not None:
        # the draft head's deferred KV is caught up from host-known positions and tokens, which a carried step
        # has not read (engine/speculative/deferred_kv.py)
        return "deferred draft KV"
    return None


def carry_inputs(batch: StepBatch, scheduled: list[ScheduledRequest], prev: InFlight, k: int, padded: bool) -> None:
    """Fill the carried requests' inputs of `batch` (built with placeholders) from `prev`'s outputs, in
    place, on the device: row j of a carried request reads N's token (j = 0) or N's draft j; every row of
    it moves back by the drafts N rejected (positions, KV slots, lengths, sampling positions).
    padded: the batch has k+1 rows per request (a graph's layout)."""
    carried = [b for b, s in enumerate(scheduled) if s.carried]
    if not carried:
        return
    device = batch.input_ids.device
    where = prev.index()
    k1 = k + 1
    starts, t = [], 0
    for s in scheduled:
        starts.append(t)
        t += k1 if padded else s.num_new_tokens
    dst_rows, src, cur, src_req, row_req, has_next = [], [], [], [], [], []
    for b in carried:
        s = scheduled[b]
        p = where[s.request.request_id]
        cur.append(b)
        src_req.append(p)
        for j in range(s.num_new_tokens):
            dst_rows.append(starts[b] + j)
            src.append((len(cur) - 1) * k1 + j)  # entry j of this request's row of `nxt` below
            row_req.append(b)
            has_next.append(j < s.num_new_tokens - 1)

    # one copy, without a sync: a blocking copy would wait for the running step
    dst_rows, src, cur, src_req, row_req, has_next = to_device(
        [np.array(dst_rows, dtype=np.int64), np.array(src, dtype=np.int64), np.array(cur, dtype=np.int64),
         np.array(src_req, dtype=np.int64), np.array(row_req, dtype=np.int64), np.array(has_next, dtype=np.bool_)],
        device).tensors

    out = prev.launched.out
    accepted = out.num_accepted.index_select(0, src_req)  # [C]
    bonus = out.tokens.index_select(0, src_req).gather(1, accepted[:, None])  # [C, 1] N's new token
    nxt = bonus if out.drafts is None else torch.cat((bonus, out.drafts.index_select(0, src_req)), 1)  # [C, k+1]
    flat = nxt.reshape(-1)
    batch.input_ids.index_copy_(0, dst_rows, flat.index_select(0, src))
    # the token after row j is input j+1 (a draft); after the last row it is sampled in the step itself
    after = torch.where(has_next, flat.index_select(0, (src + 1).clamp(max=flat.numel() - 1)), 0)
    batch.next_tokens.index_copy_(0, dst_rows, after)
    if k:
        nd = batch.num_drafts.index_select(0, cur)[:, None]
        batch.drafts.index_copy_(0, cur, torch.where(torch.arange(k, device=device) < nd, nxt[:, 1:], 0))

    prev_drafts = prev.prepared.batch.num_drafts.index_select(0, src_req)
    rejected = torch.zeros(batch.verify_rows.shape[0], dtype=torch.int64, device=device)
    rejected.index_copy_(0, cur, prev_drafts - accepted)  # [B] drafts N rejected, 0 for the others
    shift = rejected.index_select(0, row_req)
    pos = batch.positions.index_select(0, dst_rows) - shift
    batch.positions.index_copy_(0, dst_rows, pos)
    attn = batch.attn
    bs = attn.kv_cache.shape[3]
    tables = attn.block_tables.index_select(0, row_req)
    blk = tables.gather(1, (pos // bs).clamp(max=tables.shape[1] - 1)[:, None])[:, 0].to(torch.int64)
    slot = torch.where(pos < batch.slot_limit.index_select(0, row_req), blk * bs + pos % bs, -1)
    attn.slot_mapping.index_copy_(0, dst_rows, slot)
    attn.seq_lens.sub_(rejected.to(attn.seq_lens.dtype))
    batch.sampling.positions.sub_(rejected)
    attn.plans.clear()  # CPU reference plans read the lengths and slots just changed

