"""What the engine launches: every kernel launch of kernels/ over the engine's configuration space,
recorded from the wrappers themselves (kernels/_launch.py) on meta tensors, with no GPU.

The inputs are engine facts, never kernel parameters: the supported models' shapes (the zoo's
checkpoints, SmolLM2-135M, and the head dims / GQA groups / vocabularies of the supported families),
the activation dtypes, KV block sizes, batch sizes, KV lengths, speculative k from 0 to MAX_K, draft trees'
widths and node counts (tree-masked attention, dense and latent), draft vocabularies and tensor-parallel head
slices. Each point runs the `*_triton` wrappers with tensors shaped as the engine makes them (q/k/v as views
of one fused projection, caches as slices of the [L, 2, N, S, H, D] cache), so grids, constexprs and launch
options come from the launch code; a new launch shape in a wrapper shows up here without a table to update.
kernels/compile_check.py compiles what is recorded.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels._launch import Launch, recording
from kernels._verify_triton import rejection_from_probs
from kernels.attention import paged_attention_triton
from kernels.store_kv import store_kv_triton
from kernels.bitmask import apply_token_bitmask_triton
from kernels.kv_transfer import pack_kv_triton, unpack_kv_triton
from kernels.latent_rope_store import latent_rope_store_triton
from kernels.mla_attention import mla_attention_triton, store_latent_triton
from kernels.activation import silu_and_mul_triton
from kernels.norm_rope import apply_rope_triton, rms_norm_cat_triton, rms_norm_triton, rope_store_kv_triton
from kernels.draft_layout import draft_layout_triton
from kernels.tree_accept import accept_path_triton
from kernels.tree_expand import choose_triton, expand_depth_triton
from kernels.tree_outcome import observe_triton, outcome_triton
from kernels.tree_rows import store_trees_triton, tree_rows_triton
from kernels.tree_walk import walk_triton
from kernels.verify import verify_greedy_triton

ZOO_PREBUILT = Path(__file__).resolve().parents[1] / "zoo" / "prebuilt"


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The shapes of one model that reach a kernel."""

    name: str
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab: int
    draft_vocab: int | None = None  # an EAGLE-3 head's own, smaller vocabulary (bitmask through d2t)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k
    intermediate: int = 0  # the gated MLP's width (kernels/activation.py reads its tensor-parallel shards)

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim


# Published configs of the supported families (engine/config.py SUPPORTED_ARCHITECTURES): the default
# real model, head dim 128 with GQA groups 4 and 7, Qwen3's per-head norm, EAGLE-3's 32k draft vocabulary.
PUBLISHED = (
    ModelShape("SmolLM2-135M", 576, 9, 3, 64, 49152, intermediate=1536),
    ModelShape("Llama-3.1-8B", 4096, 32, 8, 128, 128256, draft_vocab=32000, intermediate=14336),
    ModelShape("Qwen2.5-7B", 3584, 28, 4, 128, 152064, intermediate=18944),
    ModelShape("Qwen3-8B", 4096, 32, 8, 128, 151936, qk_norm=True, intermediate=12288),
)


def zoo_shapes(root: Path = ZOO_PREBUILT) -> list[ModelShape]:
    """The zoo's prebuilt checkpoints (target, draft model, heads), from their config.json files."""
    shapes = {}
    for path in sorted(root.glob("*/*/config.json")):
        raw = json.loads(path.read_text())
        if "kv_lora_rank" in raw:  # MLA (the tiny-moe zoo): its attention is the latent kernel's, checked apart
            continue
        heads = raw["num_attention_heads"]
        draft_vocab = raw.get("draft_vocab_size")
        shape = ModelShape(
            f"zoo/{path.parent.parent.name}/{path.parent.name}", raw["hidden_size"], heads,
            raw.get("num_key_value_heads") or heads, raw.get("head_dim") or raw["hidden_size"] // heads,
            raw["vocab_size"], draft_vocab if draft_vocab not in (None, raw["vocab_size"]) else None,
            intermediate=raw.get("intermediate_size") or 0,
        )
        shapes.setdefault(dataclasses.replace(shape, name=""), shape)  # one per distinct shape
    return list(shapes.values())


@dataclass(frozen=True, slots=True)
class EngineSpace:
    """The engine settings that change a launch. The defaults are the engine's own (EngineConfig's block
    size and prefill budget, SpecConfig's MAX_K; tests/kernels/test_compile_check.py holds them equal):
    kept here so the check runs without importing the engine."""

    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)
    block_sizes: tuple[int, ...] = (16, 32)  # EngineConfig.block_size's default, and twice it
    max_k: int = 8  # speculative drafts per step: 0 (none, dynamic k's floor) .. SpecConfig's MAX_K
    prefill_tokens: int = 2048  # EngineConfig.max_num_batched_tokens: the longest prefill chunk
    batches: tuple[int, ...] = (1, 3, 16, 64, 256)  # decode batches: graph sizes and an odd one
    max_topk: int = 8  # draft trees: SpecConfig's MAX_TOPK, the widest expansion (the head's rows per request)
    max_tree_nodes: int = 63  # draft trees: MAX_TREE_NODES, the most nodes verified per request (plus the root)
    kv_lens: tuple[int, ...] = (17, 1000, 4096, 32768)  # short, split-KV and long contexts


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _qkv(m: ModelShape, dtype: torch.dtype, T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] as the engine has them: views of one fused projection."""
    qkv = _meta(T, m.qkv_width, dtype=dtype)
    q_w, kv_w = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    return (qkv[:, :q_w].view(T, m.num_heads, m.head_dim), qkv[:, q_w:q_w + kv_w].view(T, m.num_kv_heads, m.head_dim),
            qkv[:, q_w + kv_w:].view(T, m.num_kv_heads, m.head_dim))


def _token_launches(m: ModelShape, dtype: torch.dtype, T: int) -> None:
    """The per-token kernels of one layer over T rows: norms (with and without the residual; a draft head's two
    input norms side by side), Qwen3's per-head q/k norm, rotary embedding, the gated MLP's activation (its shard at
    tensor parallelism 1-8)."""
    hidden = _meta(T, m.hidden, dtype=dtype)
    weight = _meta(m.hidden, dtype=dtype)
    rms_norm_triton(hidden, weight, 1e-6)
    rms_norm_triton(hidden, weight, 1e-6, residual=_meta(T, m.hidden, dtype=dtype))
    rms_norm_cat_triton(hidden, weight, _meta(T, m.hidden, dtype=dtype), weight, 1e-6)  # a draft head's input
    q, k, _ = _qkv(m, dtype, T)
    if m.qk_norm:
        head_weight = _meta(m.head_dim, dtype=dtype)
        q, k = rms_norm_triton(q, head_weight, 1e-6), rms_norm_triton(k, head_weight, 1e-6)
    positions = _meta(T, dtype=torch.int64)
    for table_dtype in {torch.float32, dtype}:  # the rope table is a buffer: fp32, or cast with the model
        apply_rope_triton(q, k, positions, _meta(4096, m.head_dim, dtype=table_dtype))
    for tp in (1, 2, 4, 8):
        if m.intermediate and m.intermediate % tp == 0:
            silu_and_mul_triton(_meta(T, 2 * m.intermediate // tp, dtype=dtype))


def _attention_launches(m: ModelShape, dtype: torch.dtype, page: int, B: int, q_len: int, kv_len: int,
                        tree: bool = False) -> None:
    """KV write and attention of one layer: B requests of q_len new tokens each over kv_len positions, the
    layer's caches slices of the engine's [L, 2, N, S, Hkv, D] cache. `tree`: the attention of a draft-tree
    step, with a tree mask over the rows (its KV write is the plain step's, not recorded again)."""
    T = B * q_len
    q, k, v = _qkv(m, dtype, T)
    blocks_per_seq = -(-kv_len // page)
    kv_cache = _meta(2, 2, B * blocks_per_seq + 1, page, m.num_kv_heads, m.head_dim, dtype=dtype)
    k_cache, v_cache = kv_cache[0, 0], kv_cache[0, 1]
    if not tree:
        slots = _meta(T, dtype=torch.int64)
        store_kv_triton(k, v, k_cache, v_cache, slots)
        # Llama-family layers rotate q and k (views of the projection) in the KV store's launch
        # (engine/layers/attention.py), Qwen3's after its per-head q/k norm, in that launch too
        head_weight = _meta(m.head_dim, dtype=dtype)
        qk_norm = (head_weight, head_weight, 1e-6) if m.qk_norm else None
        for table_dtype in {torch.float32, dtype}:
            rope_store_kv_triton(q, k, v, _meta(T, dtype=torch.int64), _meta(4096, m.head_dim, dtype=table_dtype),
                                 k_cache, v_cache, slots, qk_norm)
    paged_attention_triton(q, k_cache, v_cache, _meta(B, blocks_per_seq, dtype=torch.int32),
                           _meta(B, dtype=torch.int32), _meta(B + 1, dtype=torch.int32), m.head_dim ** -0.5,
                           q_len, kv_len, tree_mask=_meta(T, dtype=torch.int64) if tree else None)


# MLA (DeepSeek-V3: kv_lora_rank 512, qk_rope_head_dim 64): the heads one rank attends with, whole (ADP) and
# under tensor parallelism over 8.
MLA_SHAPES = ((128, 512, 64), (16, 512, 64))


def _mla_launches(heads: int, latent: int, rope: int, dtype: torch.dtype, page: int, B: int, q_len: int,
                  kv_len: int, tree: bool = False) -> None:
    """Latent row write and latent attention of one layer, the layer's cache a slice of the engine's
    [L, 1, N, S, 1, latent + rope] cache; q_latent and q_rope as the model has them (a bmm output's transpose,
    a slice of the q projection). `tree`: the attention of a draft-tree step, with a tree mask over the rows
    (its row write is the plain step's, not recorded again)."""
    T = B * q_len
    blocks_per_seq = -(-kv_len // page)
    cache = _meta(2, 1, B * blocks_per_seq + 1, page, 1, latent + rope, dtype=dtype)[0, 0, :, :, 0]
    if not tree:
        kv = _meta(T, latent + rope, dtype=dtype)
        slots, positions = _meta(T, dtype=torch.int64), _meta(T, dtype=torch.int64)
        store_latent_triton(kv[:, :latent], _meta(T, rope, dtype=dtype), cache, slots)
        # the engine's Triton path: the latent's norm, the rotations and the store in one launch (views of the
        # down projection [T, latent | rope] and of q [T, heads, nope | rope], nope 128 as DeepSeek-V3's)
        q = _meta(T, heads, 128 + rope, dtype=dtype)
        for table_dtype in {torch.float32, dtype}:
            latent_rope_store_triton(kv[:, :latent], kv[:, latent:], q[..., 128:], positions,
                                     _meta(4096, rope, dtype=table_dtype), _meta(latent, dtype=dtype), 1e-6, cache,
                                     slots)
    q_latent = _meta(heads, T, latent, dtype=dtype).transpose(0, 1)
    q_rope = _meta(T, heads, rope, dtype=dtype)
    mla_attention_triton(q_latent, q_rope, cache, _meta(B, blocks_per_seq, dtype=torch.int32),
                         _meta(B, dtype=torch.int32), _meta(B + 1, dtype=torch.int32), 0.1, q_len, kv_len,
                         tree_mask=_meta(T, dtype=torch.int64) if tree else None)


def _sampling_launches(m: ModelShape, B: int, k: int) -> None:
    """Grammar masks and verification of one step: B requests with k drafts (logits are fp32). Rejection
    sampling is called past target_probs (plain torch, no kernel; slow on meta tensors)."""
    k1 = k + 1
    words = -(-m.vocab // 32)
    logits = _meta(B, k1, m.vocab)
    apply_token_bitmask_triton(logits.view(B * k1, m.vocab), _meta(B * k1, words, dtype=torch.int32),
                               _meta(B * k1, dtype=torch.bool))
    for draft_vocab in {m.vocab, m.draft_vocab or m.vocab}:  # draft steps, through d2t when smaller
        d2t = _meta(draft_vocab, dtype=torch.int64) if draft_vocab != m.vocab else None
        apply_token_bitmask_triton(_meta(B, draft_vocab), _meta(B, words, dtype=torch.int32),
                                   _meta(B, dtype=torch.bool), d2t=d2t)
    drafts = _meta(B, k, dtype=torch.int64)
    verify_greedy_triton(logits, drafts)
    seeds, positions = _meta(B, dtype=torch.int64), _meta(B, dtype=torch.int64)
    for draft_probs in (None, _meta(B, k, m.vocab)):  # greedy drafts, sampled drafts
        rejection_from_probs(logits, drafts, draft_probs, seeds, positions)


def _tree_expansion_launches(topk: int, max_depth: int, max_nodes: int) -> None:
    """A draft tree's expansion at width `topk` (kernels/tree_expand.py): each depth's scoring and frontier (the
    root's one row, then topk rows with paths of 1 .. max_depth - 1 tokens), with and without the acceptance table
    and a draft-to-target map, and the choice of the N best of all candidates (N from 2 to the most nodes). The
    batch reaches no constexpr: one batch size stands for all."""
    B, K, i64 = 3, topk, torch.int64
    for table, remap, guided in itertools.product((True, False), repeat=3):  # guided: the grammar's forced children
        for R, D in [(1, 0)] + [(K, d) for d in range(1, max_depth)]:
            root = R == 1 and D == 0
            expand_depth_triton(_meta(B, R, K), _meta(B, R, K, dtype=i64), None if root else _meta(B, R),
                                None if root else _meta(B, R, dtype=i64), _meta(B, R, dtype=torch.bool),
                                _meta(B, dtype=torch.bool), _meta(4 * K * 16) if table else None, 16,
                                _meta(1000, dtype=i64) if remap else None,
                                None if root else _meta(B, R, D, dtype=i64),
                                None if root else _meta(B, R, dtype=i64), K, D * K, (D + 1) * K,
                                forced_child=_meta(B, R, dtype=i64) if guided else None)
    C = K + (max_depth - 1) * K * K
    for n in sorted({min(v, C) for v in (2, 4, 8, 16, 32, max_nodes)}):
        # depths None: the engine's expansion (each node's depth from its parents)
        choose_triton(_meta(B, C, dtype=i64), _meta(B, C), _meta(B, C, dtype=i64), None, n,
                      _meta(B, C, dtype=i64), _meta(B, C, dtype=torch.bool), max_depth)


def _tree_walk_launches(max_depth: int, max_nodes: int) -> None:
    """The walk down a verified tree (kernels/tree_walk.py) at every node-count block, 2 .. the most nodes (the
    depth is not a constexpr)."""
    for n in (2, 4, 8, 16, 32, max_nodes):
        walk_triton(_meta(3, n + 1, dtype=torch.int64), _meta(3, n, dtype=torch.int64), _meta(3, n, dtype=torch.int64),
                    _meta(3, dtype=torch.int64), max_depth)


def _draft_layout_launches(max_topk: int) -> None:
    """The rows of a step's draft passes (kernels/draft_layout.py): a chain's (width 1) and every tree width; the
    pass count, batch and table width reach no constexpr."""
    i64 = torch.int64
    for width in range(1, max_topk + 1):
        draft_layout_triton(_meta(3, 8, dtype=torch.int32), _meta(3, dtype=i64), _meta(3, dtype=i64), 16, 2, width)


def _tree_step_launches(max_depth: int, max_topk: int, max_nodes: int) -> None:
    """A tree step's verification rows and the trees' store by slot (kernels/tree_rows.py) and its nodes' outcomes
    (tree_outcome.py) at every node-count block and depth, and the acceptance table's update at every width."""
    i64 = torch.int64
    for n in sorted({2, 4, 8, 16, 32, max_nodes}):
        tree_rows_triton(_meta(3, n + 1, dtype=i64), _meta(3, dtype=i64), _meta(3, dtype=i64), _meta(9, n, dtype=i64),
                         _meta(9, n + 1, dtype=i64), _meta(9, n + 1, dtype=i64), _meta(9, n, dtype=i64),
                         _meta(40, dtype=i64), _meta(3, dtype=torch.int32))
        for cells in (True, False):  # the expansion's trees scored, a handed-over one not
            store_trees_triton(_meta(3, dtype=i64), _meta(3, n, dtype=i64), _meta(3, n + 1, dtype=i64),
                               _meta(3, n + 1, dtype=i64), _meta(3, n, dtype=i64) if cells else None,
                               _meta(9, n, dtype=i64), _meta(9, n + 1, dtype=i64), _meta(9, n + 1, dtype=i64),
                               _meta(9, n, dtype=i64))
        for k in range(1, max_depth + 1):
            outcome_triton(_meta(3, k + 1, dtype=i64), _meta(3, n, dtype=i64), _meta(3, dtype=i64))
    for topk in range(2, max_topk + 1):
        cells = 4 * topk * 16  # engine/speculative/tree_score.py: CLASSES x topk x NUM_BUCKETS
        observe_triton(_meta(cells), _meta(cells), _meta(cells), _meta(3, 8, dtype=i64), _meta(3, 8, dtype=torch.bool),
                       _meta(3, 8, dtype=torch.bool), 512.0)


def _tree_compact_launches(dtype: torch.dtype, max_depth: int) -> None:
    """The accepted path's compaction (kernels/tree_accept.py) at every depth, for a KV cache of `dtype` (moved as
    integers of its width: the model's layers, heads and dims reach no constexpr)."""
    i64 = torch.int64
    kv_cache = _meta(2, 2, 64, 16, 3, 64, dtype=dtype)
    for k in range(1, max_depth + 1):
        accept_path_triton(kv_cache, _meta(20, dtype=i64), _meta(3, 6, dtype=i64), _meta(3, k + 1, dtype=i64),
                           _meta(3, dtype=i64), _meta(20, dtype=i64), _meta(3, k + 1, dtype=i64),
                           _meta(3, dtype=torch.bool))


def _handover_launches(m: ModelShape, dtype: torch.dtype, page: int) -> None:
    """KV hand-over: whole caches, and head slices for a tp=2 receiver."""
    kv_cache = _meta(2, 2, 64, page, m.num_kv_heads, m.head_dim, dtype=dtype)
    slices = [(0, m.num_kv_heads)]
    if m.num_kv_heads % 2 == 0:
        slices.append((m.num_kv_heads // 2, m.num_kv_heads))
    for n in (1, 5, 64):
        ids = _meta(n, dtype=torch.int64)
        for h0, h1 in slices:
            buffer = pack_kv_triton(kv_cache, ids, head_start=h0, head_end=h1)
            unpack_kv_triton(buffer, kv_cache, ids, head_start=h0)


def _latent_handover_launches(latent: int, rope: int, dtype: torch.dtype, page: int) -> None:
    """KV hand-over of an MLA cache: one plane, the whole latent row to every rank (never a head slice)."""
    kv_cache = _meta(2, 1, 64, page, 1, latent + rope, dtype=dtype)
    for n in (1, 5, 64):
        ids = _meta(n, dtype=torch.int64)
        unpack_kv_triton(pack_kv_triton(kv_cache, ids), kv_cache, ids)


def _distinct(models: list[ModelShape], *fields: str) -> list[ModelShape]:
    """One model per distinct value of `fields` (what a scenario reads of a model)."""
    seen = {}
    for m in models:
        seen.setdefault(tuple(getattr(m, f) for f in fields), m)
    return list(seen.values())


def scenarios(models: list[ModelShape], space: EngineSpace) -> Iterator[tuple[str, Callable[[], None]]]:
    """(description, call) for every engine situation that launches kernels. Each family of kernels is
    swept over the models' shapes it reads, so equal shapes are not recorded twice."""
    steps = [(B, k + 1) for B in space.batches for k in range(space.max_k + 1)]  # decode and verification
    steps += [(B, space.prefill_tokens) for B in (1, 3)]  # prefill chunks
    # Draft trees (engine/speculative/tree.py, tree_step.py): the head's expansion attends with topk rows per
    # request, the target verifies N + 1 rows (N = k .. 63 nodes and the root), and a prompt chunk can share
    # the target's tree-masked forward.
    tree_rows = range(2, max(space.max_topk, space.max_tree_nodes + 1) + 1)
    tree_steps = [(B, q_len, [L for L in space.kv_lens if L > q_len]) for B in space.batches for q_len in tree_rows]
    tree_steps += [(B, space.prefill_tokens, (space.prefill_tokens, 4 * space.prefill_tokens)) for B in (1, 3)]
    for dtype in space.dtypes:
        dt = str(dtype).removeprefix("torch.")
        for m in _distinct(models, "hidden", "num_heads", "num_kv_heads", "head_dim", "qk_norm", "intermediate"):
            for T in sorted({B * q_len for B, q_len in steps}):
                yield (f"{m.name} {dt}: norm, rope and activation, {T} rows",
                       lambda m=m, d=dtype, T=T: _token_launches(m, d, T))
        for m in _distinct(models, "num_heads", "num_kv_heads", "head_dim", "qk_norm"):
            for page in space.block_sizes:
                for B, q_len in steps:
                    for kv_len in space.kv_lens if q_len <= space.max_k + 1 else (q_len, 4 * q_len):
                        yield (f"{m.name} {dt} block {page}: attention B={B} q_len={q_len} kv={kv_len}",
                               lambda m=m, d=dtype, p=page, B=B, q=q_len, L=kv_len: _attention_launches(
                                   m, d, p, B, q, L))
                for B, q_len, kv_lens in tree_steps:
                    for kv_len in kv_lens:
                        yield (f"{m.name} {dt} block {page}: tree attention B={B} q_len={q_len} kv={kv_len}",
                               lambda m=m, d=dtype, p=page, B=B, q=q_len, L=kv_len: _attention_launches(
                                   m, d, p, B, q, L, tree=True))
        for heads, latent, rope in MLA_SHAPES:
            for page in space.block_sizes:
                for B, q_len in steps:
                    for kv_len in space.kv_lens if q_len <= space.max_k + 1 else (q_len, 4 * q_len):
                        yield (f"MLA {heads}x{latent}+{rope} {dt} block {page}: B={B} q_len={q_len} kv={kv_len}",
                               lambda h=heads, lt=latent, r=rope, d=dtype, p=page, B=B, q=q_len, L=kv_len:
                               _mla_launches(h, lt, r, d, p, B, q, L))
                for B, q_len, kv_lens in tree_steps:  # DeepSeek-V3 targets and their own MTP layer
                    for kv_len in kv_lens:
                        yield (f"MLA {heads}x{latent}+{rope} {dt} block {page}: tree B={B} q_len={q_len} "
                               f"kv={kv_len}", lambda h=heads, lt=latent, r=rope, d=dtype, p=page, B=B, q=q_len,
                               L=kv_len: _mla_launches(h, lt, r, d, p, B, q, L, tree=True))
        for m in _distinct(models, "num_kv_heads", "head_dim"):
            for page in space.block_sizes:
                yield f"{m.name} {dt} block {page}: hand-over", lambda m=m, d=dtype, p=page: _handover_launches(m, d, p)
        for latent, rope in sorted({(latent, rope) for _, latent, rope in MLA_SHAPES}):
            for page in space.block_sizes:
                yield (f"MLA {latent}+{rope} {dt} block {page}: hand-over",
                       lambda lt=latent, r=rope, d=dtype, p=page: _latent_handover_launches(lt, r, d, p))
    for topk in range(2, space.max_topk + 1):
        yield (f"draft tree expansion topk={topk}",
               lambda K=topk: _tree_expansion_launches(K, space.max_k, space.max_tree_nodes))
    yield "draft tree walk", lambda: _tree_walk_launches(space.max_k, space.max_tree_nodes)
    yield "draft pass layout", lambda: _draft_layout_launches(space.max_topk)
    yield "draft tree rows and outcomes", lambda: _tree_step_launches(space.max_k, space.max_topk, space.max_tree_nodes)
    for dtype in space.dtypes:
        yield (f"draft tree compaction {str(dtype).removeprefix('torch.')}",
               lambda d=dtype: _tree_compact_launches(d, space.max_k))
    for m in _distinct(models, "vocab", "draft_vocab"):
        for B in space.batches:
            for k in range(space.max_k + 1):
                yield f"{m.name}: sampling B={B} k={k}", lambda m=m, B=B, k=k: _sampling_launches(m, B, k)


@dataclass(frozen=True, slots=True)
class Recorded:
    scenario: str
    launch: Launch


def record(sm_count: int, models: list[ModelShape], space: EngineSpace) -> tuple[list[Recorded], list[str]]:
    """(every launch of every scenario as the wrappers make it on a GPU with `sm_count` SMs, the scenarios
    whose wrapper failed before launching, each with its error)."""
    launches, failures = [], []
    for name, call in scenarios(models, space):
        with recording(sm_count) as rec:
            try:
                call()
            except Exception as e:  # noqa: BLE001 - any wrapper error is a finding, reported with its scenario
                failures.append(f"{name}: {type(e).__name__}: {e}")
        launches += [Recorded(name, launch) for launch in rec.launches]
    return launches, failures
