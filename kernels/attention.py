"""Paged KV cache writes and varlen paged attention (prefill, chunked prefill, decode, speculation).

Layout shared with the engine: per layer `k_cache`, `v_cache` are `[num_blocks, block_size, num_kv_heads,
head_dim]`, contiguous; the slot of a token is `block_id * block_size + offset`. A batch is a flattened
varlen set of B requests: request b owns query rows `query_start_loc[b]:query_start_loc[b+1]`, and its
new tokens sit at the end of its `seq_lens[b]` KV positions (store_kv has already written them).

Each public function picks the Triton kernel on CUDA (or everywhere when TRITON_INTERPRET=1) and the
vectorized torch reference otherwise; on a CPU the engine's attention layer runs its short requests through the
C++ kernel instead (paged_attention_cpu, kernels/cpu/paged_attention.cpp). The Triton path reads no tensor data on
the host: launch bounds (`max_q_len`, `max_seq_len`) are host ints supplied by the caller, so it is CUDA-graph
capturable. The reference's attention plan reads the query lengths on the host when a step has a long query (it runs
eagerly, never in a graph) to pad decode rows and prefill chunks separately.
"""
import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import _attention_triton as _tr
from kernels import cpu_ext
from kernels._dispatch import next_pow2, use_triton
from kernels._launch import launch, multiprocessor_count, on_gpu


from kernels.store_kv import StorePlan, check_cache, plan_store_kv


# ---------------------------------------------------------------------------------- paged attention


# Requests with at most this many new tokens (decode, k+1 verification chains) are padded together;
# longer ones (prefill chunks) form a second group, so one long chunk does not pad every decode row.
DECODE_GROUP_MAX_Q = 16


@dataclass(frozen=True, slots=True)
class _PlanGroup:
    B: int
    L: int  # padded KV length
    mq: int  # padded query length
    slots: torch.Tensor  # [B * L] flat cache slot of each padded KV position
    rows: torch.Tensor | None  # [B * mq] query row of each padded query position (None: uniform plan)
    mask: torch.Tensor  # [B, 1, G * mq, L] bool ([B, 1, 1, L] in a uniform plan with mq = 1)
    token_rows: torch.Tensor | None  # [n] the token rows of the group's requests (None: uniform plan)
    padded_rows: torch.Tensor | None  # [n] their padded query positions (b * mq + i)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """The index math of paged_attention_ref for one step: it depends only on the step's metadata
    (block tables, lengths, query layout) and the GQA group size, so every layer of a step shares
    one plan and only gathers, one SDPA call per group and a scatter remain per layer."""

    T: int
    B: int
    G: int  # query heads per KV head
    groups: tuple[_PlanGroup, ...]
    in_batch: torch.Tensor | None  # [T, 1, 1] bool: the row belongs to a request (None: uniform)
    # Host fact (CPU metadata only): request b owns rows b*mq .. b*mq + mq - 1 and nothing pads, as in
    # every decode step (mq = 1, or k+1 with full drafts). The queries are then already the padded
    # batch: no gather of queries, no scatter of outputs, no zeroing of padding rows.
    uniform: bool = False


def _plan_group(block_tables, seq, q_start, q_len, T: int, S: int, G: int, max_q: int, max_seq: int,
                tree_mask: torch.Tensor | None = None) -> _PlanGroup:
    B, dev = block_tables.shape[0], block_tables.device
    L = max(1, min(max_seq, block_tables.shape[1] * S))
    mq = max(1, max_q)
    ctx = seq - q_len  # [B] tokens already in the cache before this chunk
    kpos = torch.arange(L, device=dev)
    qi = torch.arange(mq, device=dev)
    # KV gathered per slot into [B, L]. Positions past seq_len read the request's position 0 instead
    # of whatever the cache holds there: the cache may hold garbage (even NaN) in unwritten slots, and
    # a masked softmax still multiplies 0 * V. index_select is far faster than advanced indexing on CPU.
    pos = torch.where(kpos[None, :] < seq[:, None], kpos[None, :], 0)  # [B, L]
    page = block_tables.gather(1, (pos // S).clamp_(max=block_tables.shape[1] - 1)).long()
    slots = (page * S + pos % S).view(-1)
    rows = q_start[:, None] + qi[None, :]  # [B, mq]
    valid = qi[None, :] < q_len[:, None]
    # Causal + length mask [B, 1, G * mq, L]; padded query rows get key 0 so no row is fully masked.
    qpos = ctx[:, None] + qi[None, :]  # [B, mq]
    mask = kpos[None, None, :] <= qpos[:, :, None]
    if tree_mask is not None:
        bits = tree_mask.index_select(0, rows.clamp(max=max(T - 1, 0)).view(-1)).view(B, mq)
        mask = mask & tree_admits(bits, seq, kpos)
    mask = mask | (kpos == 0)[None, None, :]
    mask = mask[:, None, None].expand(B, 1, G, mq, L).reshape(B, 1, G * mq, L)
    padded = torch.arange(B * mq, device=dev).view(B, mq)
    return _PlanGroup(B, L, mq, slots, rows.clamp(max=max(T - 1, 0)).view(-1), mask, rows[valid], padded[valid])


def tree_admits(bits: torch.Tensor, seq: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor:
    """bits [B, mq] int64 tree masks of query rows, seq [B] KV lengths, kpos [L] KV positions -> [B, mq, L] bool:
    bit w of a row admits position seq - 64 + w; positions before seq - 64 are not the mask's to refuse."""
    w = kpos[None, :] - (seq[:, None] - 64)  # [B, L]
    bit = (bits[:, :, None] >> w.clamp(0, 63)[:, None, :]) & 1
    return (w < 0)[:, None, :] | (bit != 0)


def _one_row_slots(block_tables, seq, S: int, max_seq: int):
    """The KV index math of uniform plans, for P sets of KV lengths seq [P, B] over the same block tables
    (P = 1 for one step; a draft chain's passes at once): -> (L, kpos [L], pos [P, B, L], slots [P, B * L]).
    Past seq_len a position reads position 0 instead (as _plan_group)."""
    P, B = seq.shape
    M = block_tables.shape[1]
    L = max(1, min(max_seq, M * S))
    kpos = torch.arange(L, device=block_tables.device)
    pos = torch.where(kpos < seq[..., None], kpos, 0)
    pages = (pos // S).clamp_(max=M - 1).permute(1, 0, 2).reshape(B, P * L)
    page = block_tables.gather(1, pages).long().view(B, P, L).permute(1, 0, 2)
    return L, kpos, pos, (page * S + pos % S).reshape(P, B * L)


def _plan_uniform(block_tables, seq, S: int, G: int, mq: int, max_seq: int) -> _PlanGroup:
    """_plan_group for a uniform layout (request b owns query rows b*mq + i): the same slots and mask,
    without the query rows' gather and scatter indices. With mq = 1 (decode, draft chains) the mask is
    only the length mask, [B, 1, 1, L], and SDPA broadcasts it over the G query heads."""
    B, dev = block_tables.shape[0], block_tables.device
    L, kpos, pos, slots = _one_row_slots(block_tables, seq[None], S, max_seq)
    pos, slots = pos[0], slots[0]  # [B, L], [B * L]
    if mq == 1:
        return _PlanGroup(B, L, 1, slots, None, (pos > 0)[:, None, None] | (kpos == 0), None, None)
    qpos = (seq - mq)[:, None] + torch.arange(mq, device=dev)  # [B, mq]
    mask = (kpos <= qpos[:, :, None]) | (kpos == 0)
    mask = mask[:, None, None].expand(B, 1, G, mq, L).reshape(B, 1, G * mq, L)
    return _PlanGroup(B, L, mq, slots, None, mask, None, None)


def plan_paged_attention(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         num_tokens: int, page_size: int, group: int, max_q_len: int,
                         max_seq_len: int, tree_mask: torch.Tensor | None = None) -> AttentionPlan:
    T, B = num_tokens, block_tables.shape[0]
    mq = max(1, max_q_len)
    if (tree_mask is None and T == B * mq and query_start_loc.device.type == "cpu"
            and torch.equal(query_start_loc, torch.arange(0, T + 1, mq, dtype=query_start_loc.dtype))):
        return AttentionPlan(T, B, group, (_plan_uniform(block_tables, seq_lens.long(), page_size, group, mq,
                                                         max_seq_len),), None, True)
    q_start = query_start_loc[:-1].long()
    q_len = query_start_loc[1:].long() - q_start  # [B]
    seq = seq_lens.long()
    parts = [list(range(B))]
    if max_q_len > DECODE_GROUP_MAX_Q:  # only then can the batch mix short and long queries
        host_q = q_len.tolist()
        short = [b for b, n in enumerate(host_q) if n <= DECODE_GROUP_MAX_Q]
        if 0 < len(short) < B:
            parts = [short, [b for b, n in enumerate(host_q) if n > DECODE_GROUP_MAX_Q]]
    groups = []
    for members in parts:  # a tree mask is indexed by token row, so every group reads it whole
        if len(parts) == 1:
            tables, s, qs, ql, max_q, max_seq = block_tables, seq, q_start, q_len, max_q_len, max_seq_len
        else:
            idx = torch.tensor(members, device=block_tables.device)
            tables, s, qs, ql = (x.index_select(0, idx) for x in (block_tables, seq, q_start, q_len))
            max_q, max_seq = max(host_q[b] for b in members), min(max_seq_len, int(s.max()))
        groups.append(_plan_group(tables, s, qs, ql, T, page_size, group, max_q, max_seq, tree_mask))
    in_batch = torch.arange(T, device=block_tables.device) < query_start_loc[-1].long()
    return AttentionPlan(T, B, group, tuple(groups), in_batch[:, None, None])


def plan_chain(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [P, B] int32: pass p's KV length of each request (one new query row each)
    slot_mapping: torch.Tensor,  # [P, B] int64: pass p's slots, -1 = not written
    page_size: int,
    group: int,
    max_seq_len: int,  # host bound on seq_lens
) -> list[tuple[StorePlan, AttentionPlan]]:
    """The reference path's plans (plan_store_kv, plan_paged_attention) of P passes that each run one query
    row per request over the same block tables: a draft chain's passes. Made together, one set of index
    ops and one host read for all P instead of per pass (~110 us a pass on a CPU); the same plans."""
    P, B = seq_lens.shape
    L, kpos, pos, slots = _one_row_slots(block_tables, seq_lens.long(), page_size, max_seq_len)
    mask = (pos > 0)[:, :, None, None] | (kpos == 0)  # [P, B, 1, 1, L]
    every_row = (slot_mapping >= 0).all(1).tolist()  # the one host read
    plans = []
    for p in range(P):
        sm = slot_mapping[p]
        store = StorePlan(sm, sm, sm.new_zeros((), dtype=torch.bool), True) if every_row[p] else plan_store_kv(sm)
        attend = AttentionPlan(B, B, group, (_PlanGroup(B, L, 1, slots[p], None, mask[p], None, None),), None, True)
        plans.append((store, attend))
    return plans


def paged_attention_ref(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [N, S, Hkv, D]
    v_cache: torch.Tensor,  # [N, S, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, KV length including the new tokens
    query_start_loc: torch.Tensor,  # [B+1] int32
    scale: float,
    max_q_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    plan: AttentionPlan | None = None,  # plan_paged_attention(...) of this step, shared by its layers
    tree_mask: torch.Tensor | None = None,  # [T] int64, bit w admits KV position seq_len - 64 + w (tree_mask.py)
) -> torch.Tensor:
    """Gather each request's KV into a padded batch and run one masked SDPA call per group of
    similar query lengths (no per-request loop). A plan made with a tree mask carries it."""
    check_cache(k_cache, v_cache)
    T, Hq, D = query.shape
    _, S, Hkv, _ = k_cache.shape
    B = block_tables.shape[0]
    G = Hq // Hkv
    assert Hq == G * Hkv and k_cache.shape[3] == D
    if T == 0 or B == 0:
        return out if out is not None else torch.zeros_like(query)
    if plan is None:
        plan = plan_paged_attention(block_tables, seq_lens, query_start_loc, T, S, G, max_q_len, max_seq_len,
                                    tree_mask)
    assert (plan.T, plan.B, plan.G) == (T, B, G), "the plan was made for another batch"
    k_flat, v_flat = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    if plan.uniform:
        g = plan.groups[0]
        b, L, mq = g.B, g.L, g.mq
        k = k_flat.index_select(0, g.slots).view(b, L, Hkv, D).transpose(1, 2)
        v = v_flat.index_select(0, g.slots).view(b, L, Hkv, D).transpose(1, 2)
        q = query.reshape(b, mq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(b, Hkv, G * mq, D)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)  # [b, Hkv, G * mq, D]
        o = o.view(b, Hkv, G, mq, D).permute(0, 3, 1, 2, 4).reshape(T, Hq, D)
        return o.to(query.dtype) if out is None else out.copy_(o)
    if out is None:
        out = torch.zeros_like(query)
    for g in plan.groups:
        b, L, mq = g.B, g.L, g.mq
        k = k_flat.index_select(0, g.slots).view(b, L, Hkv, D).transpose(1, 2)
        v = v_flat.index_select(0, g.slots).view(b, L, Hkv, D).transpose(1, 2)
        # Queries: padded [b, mq, Hq, D], then the G query heads of a KV head folded into the row dim
        # so that KV is never expanded for GQA: [b, Hkv, G * mq, D].
        q = query.index_select(0, g.rows).view(b, mq, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(b, Hkv, G * mq, D)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=g.mask, scale=scale)  # [b, Hkv, G * mq, D]
        o = o.view(b, Hkv, G, mq, D).permute(0, 3, 1, 2, 4).reshape(b * mq, Hq, D)
        out.index_copy_(0, g.token_rows, o.index_select(0, g.padded_rows).to(out.dtype))
    return out.masked_fill_(~plan.in_batch, 0)


def paged_attention_triton(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_q_len, max_seq_len,
    out=None, num_splits: int | None = None, tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton varlen paged attention; `num_splits > 1` splits each request's KV (flash decoding) and
    combines the partial results by log-sum-exp. None picks splits from the launch size.

    fp32 inputs use IEEE fp32 dots (no TF32). bf16 off-GPU (the interpreter, whose bf16 arithmetic
    is wrong in triton 3.x) is upcast to fp32 in registers; on CUDA bf16/fp16 dots accumulate in fp32.
    """
    check_cache(k_cache, v_cache)
    T, Hq, D = query.shape
    N, S, Hkv, Dk = k_cache.shape
    B = block_tables.shape[0]
    assert Dk == D and Hq % Hkv == 0, (query.shape, k_cache.shape)
    assert query.dtype == k_cache.dtype and query.stride(2) == 1, (query.dtype, query.stride())
    assert block_tables.dtype == torch.int32 and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.shape == (B,)
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (B + 1,)
    assert seq_lens.is_contiguous() and query_start_loc.is_contiguous()
    if tree_mask is not None:
        assert tree_mask.dtype == torch.int64 and tree_mask.shape == (T,) and tree_mask.is_contiguous()
    if out is None:
        out = torch.zeros_like(query)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    if T == 0 or B == 0 or max_q_len == 0:
        return out
    G = Hq // Hkv
    gpu = on_gpu(query)
    fp32_dot = query.dtype == torch.float32 or (query.dtype == torch.bfloat16 and not gpu)
    cfg = _tr.attention_config(G, max_q_len, D, fp32_dot, gpu)
    q_blocks = -(-max_q_len // cfg.tokens_per_block)
    if num_splits is None:
        sm_count = multiprocessor_count(query.device) if gpu else None
        num_splits = _tr.pick_num_splits(q_blocks * B * Hkv, max_seq_len, sm_count)
    chunk = -(-max(1, max_seq_len) // num_splits)
    chunk = -(-chunk // cfg.block_n) * cfg.block_n
    num_splits = -(-max(1, max_seq_len) // chunk)
    if num_splits == 1:
        part_out, part_lse = out, out  # unused by the kernel without SPLIT
        o_strides, l_strides = (0, out.stride(0), out.stride(1)), (0, 0)
    else:
        part_out = torch.empty((num_splits, T, Hq, D), device=query.device, dtype=torch.float32)
        part_lse = torch.empty((num_splits, T, Hq), device=query.device, dtype=torch.float32)
        o_strides, l_strides = part_out.stride()[:3], part_lse.stride()[:2]
    launch(
        _tr.paged_attention_kernel, (q_blocks, B, Hkv * num_splits),
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, part_out, part_lse,
        tree_mask if tree_mask is not None else seq_lens,  # any pointer when TREE is off
        scale * math.log2(math.e),
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        o_strides[0], o_strides[1], o_strides[2],
        l_strides[0], l_strides[1],
        chunk, num_splits,
        G=G, PAGE=S, HEAD_DIM=D, BLOCK_D=next_pow2(max(D, 16)),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SPLIT=num_splits > 1,
        FP32_DOT=fp32_dot, TREE=tree_mask is not None, num_warps=cfg.num_warps,
    )
    if num_splits > 1:
        launch(
            _tr.combine_splits_kernel, (max_q_len, B, Hq), part_out, part_lse, query_start_loc, out,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=D, BLOCK_D=next_pow2(D), SPLITS_P2=next_pow2(num_splits),
        )
    return out


# Requests of at most this many rows (decode, draft and verification chains, trees) attend through the C++ CPU
# kernel; longer ones (prefill chunks) through the reference, whose blocked SDPA is faster there
# (bench/results/cpu_attention_cpu.md). A short request's rows come from the kernel whatever else is in the step,
# so a request's tokens do not depend on its batch.
CPU_KERNEL_MAX_Q = 16
CPU_KERNEL_HEAD_DIMS = (16, 32, 40, 48, 64, 80, 96, 128, 256)  # instantiated in the C++ (a constant: unrolled)


def cpu_kernel_serves(query: torch.Tensor) -> bool:
    """Whether CPU attention over `query`'s head dim runs paged_attention_cpu (for its short requests)."""
    return (not use_triton(query) and query.device.type == "cpu" and query.shape[-1] in CPU_KERNEL_HEAD_DIMS
            and cpu_ext.available())


def paged_attention_cpu(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out=None, tree_mask=None,
    key=None, value=None, slot_mapping=None, max_rows: int | None = None,
) -> torch.Tensor:
    """paged_attention in one C++ call on a CPU (kernels/cpu/paged_attention.cpp), with store_kv fused in when
    `key`, `value` and `slot_mapping` are given (written first, as store_kv would). `max_rows`: requests with more
    query rows are skipped, their rows of `out` left as they are. Needs cpu_ext.available()."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    return torch.ops.tandem_cpu.paged_attention(query, key, value, k_cache, v_cache, slot_mapping, block_tables,
                                                seq_lens, query_start_loc, tree_mask, float(scale),
                                                -1 if max_rows is None else int(max_rows), out)


@contextlib.contextmanager
def cpu_attention_step(kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc, tree_mask=None):
    """Inside: paged_attention_layer reads this step (a compiled forward's attentions, on this thread). kv_cache
    [layers, 2, blocks, block_size, Hkv, D]; the rest as paged_attention_cpu's, slot_mapping giving the step's rows.
    Needs cpu_ext.available()."""
    torch.ops.tandem_cpu.attention_step_begin(kv_cache, slot_mapping, block_tables, seq_lens, query_start_loc,
                                              tree_mask)
    try:
        yield
    finally:
        torch.ops.tandem_cpu.attention_step_end()


def paged_attention_layer(query, key, value, layer: int, scale: float) -> torch.Tensor:
    """paged_attention_cpu of layer `layer` of the cpu_attention_step around it, stores fused in: query/key/value may
    have more rows than the step (a compiled graph's padding bucket), and those rows of the result are zero."""
    return torch.ops.tandem_cpu.paged_attention_layer(query, key, value, int(layer), float(scale))


def paged_attention(
    query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_q_len, max_seq_len,
    out=None, plan: AttentionPlan | None = None, tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of `query` `[T, Hq, D]` over paged KV; returns `out` `[T, Hq, D]`.
    `tree_mask` [T] int64 (speculation's draft trees, kernels/tree_mask.py): within the last 64 KV positions of
    its request a row attends only where its bit is set (bit w: position seq_len - 64 + w), and causally; all
    bits set is plain causal attention. A reference `plan` must have been made with the same mask.

    Rows of T past `query_start_loc[B]` belong to no request: zero (reference, or fresh `out`) or
    untouched (Triton with a caller `out`). `max_q_len`/`max_seq_len` must bound the batch's maxima.
    """
    if use_triton(query):
        return paged_attention_triton(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                      max_q_len, max_seq_len, out, tree_mask=tree_mask)
    return paged_attention_ref(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, max_q_len,
                               max_seq_len, out, plan, tree_mask)
