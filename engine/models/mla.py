"""Multi-head latent attention (DeepSeek-V2/V3) over the latent paged cache, in the absorbed form.

Per token the layer caches only c = kv_a_layernorm(x W_DKV) [kv_lora_rank] and the rotated rope key
[qk_rope_head_dim], shared by every head. Keys and values per head would be c W_UK and c W_UV (kv_b_proj's
two halves); instead W_UK is folded into each head's query (q_latent = q_nope W_UK, [T, H, L]) and W_UV
into the output (attention output in latent space, then W_UV), so attention reads the cache as it is, for
prefill chunks, decode rows and verification chains alike (one path for a mixed step).

Tensor parallelism shards heads (q_b_proj / q_proj, kv_b_proj, o_proj); the down projections and the latent
cache are replicated on every rank, the reason MLA is served with attention data parallelism.

DeepSeek publishes its rope features as interleaved pairs (x0, x1), (x2, x3), ...; loading permutes those rows
of the q and kv_a projections to the halves layout (evens, then odds) the rotary kernels use: the same
rotation of the same pairs, so scores are unchanged, at no cost per step.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.parallel import TPContext
from engine.errors import ModelLoadError
from engine.layers.latent_attention import LatentPagedAttention
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear, copy_checked
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeAt, RotaryEmbedding

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not config.rms_norm_eps


def deinterleave(width: int) -> torch.Tensor:
    """[width] the halves layout's source index of each feature: evens, then odds."""
    return torch.cat([torch.arange(0, width, 2), torch.arange(1, width, 2)])


class RopeRowsLinear(ColumnParallelLinear):
    """A column-parallel linear whose checkpoint rows are permuted by `row_order` (full-size) before slicing."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPContext, row_order: torch.Tensor | None):
        super().__init__(in_features, out_features, bias, tp)
        self.row_order = row_order

    def load(self, name: str, tensor: torch.Tensor, shard_id=None) -> None:
        if self.row_order is not None and tensor.shape[0] == self.row_order.numel():
            tensor = tensor.index_select(0, self.row_order.to(tensor.device))
        super().load(name, tensor, shard_id)


class KVUpProjection(nn.Module):
    """kv_b_proj [H * (nope + v), L], never run as a linear: its halves are W_UK (folded into queries) and W_UV
    (folded into outputs). Sharded by heads."""

    def __init__(self, kv_lora_rank: int, num_heads: int, nope: int, v: int, tp: TPContext):
        super().__init__()
        self.tp, self.num_heads, self.nope, self.v = tp, num_heads, nope, v
        self.head_start, self.local_heads = tp.shard(num_heads, "num_attention_heads")
        self.weight = nn.Parameter(torch.empty(self.local_heads * (nope + v), kv_lora_rank), requires_grad=False)

    def load(self, name: str, tensor: torch.Tensor, shard_id=None) -> None:
        width = self.nope + self.v
        if tuple(tensor.shape) != (self.num_heads * width, self.weight.shape[1]):
            raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{(self.num_heads * width, self.weight.shape[1])}")
        copy_checked(self.weight, tensor.narrow(0, self.head_start * width, self.local_heads * width), name)

    def halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H_local, nope, L], W_UV [H_local, v, L]) as views of the weight."""
        w = self.weight.unflatten(0, (self.local_heads, self.nope + self.v))
        return w[:, : self.nope], w[:, self.nope:]


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPContext, rotary: RotaryEmbedding):
        super().__init__()
        mla = cfg.mla
        H, self.nope, self.rope, self.v = cfg.num_heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        qk = self.nope + self.rope
        self.local_heads = tp.shard(H, "num_attention_heads")[1]
        whole = TPContext()  # the down projections are replicated on every rank
        # rows of the q projection, per head [nope | rope], and of kv_a [latent | rope]: rope pairs de-interleaved
        q_order = kv_order = None
        if mla.rope_interleave:
            per_head = torch.cat([torch.arange(self.nope), self.nope + deinterleave(self.rope)])
            q_order = (torch.arange(H)[:, None] * qk + per_head[None, :]).reshape(-1)
            kv_order = torch.cat([torch.arange(self.kv_lora_rank), self.kv_lora_rank + deinterleave(self.rope)])
        self.q_lora = mla.q_lora_rank is not None
        if not self.q_lora:
            self.q_proj = RopeRowsLinear(cfg.hidden_size, H * qk, False, tp, q_order)
        else:
            self.q_a_proj = ColumnParallelLinear(cfg.hidden_size, mla.q_lora_rank, mla.attention_bias, whole)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = RopeRowsLinear(mla.q_lora_rank, H * qk, False, tp, q_order)
        self.kv_a_proj_with_mqa = RopeRowsLinear(cfg.hidden_size, mla.cache_width, mla.attention_bias, whole, kv_order)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = KVUpProjection(self.kv_lora_rank, H, self.nope, self.v, tp)
        self.o_proj = RowParallelLinear(H * self.v, cfg.hidden_size, mla.attention_bias, tp)
        self.rotary = rotary
        self.attn = LatentPagedAttention(layer_idx, self.local_heads, self.kv_lora_rank, self.rope,
                                         mla.softmax_scale(cfg.rope_scaling))

    def forward(self, rope: RopeAt, x: torch.Tensor) -> torch.Tensor:
        """rope: the forward's positions (RotaryEmbedding.at); x [T, hidden] -> [T, hidden]."""
        T = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(T, self.local_heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        w_uk, w_uv = self.kv_b_proj.halves()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, L]
        if rope.fused:  # the Triton path: the latent's norm, q's and k's rotation and the cache store in one launch
            norm = self.kv_a_layernorm
            out = self.attn(q_latent, q_pe, latent, k_pe, (rope, norm.weight, norm.eps))  # [T, H, L]
        else:
            latent = self.kv_a_layernorm(latent)  # [T, L]
            q_pe, k_pe = self.rotary(rope, q_pe, k_pe.view(T, 1, self.rope))  # [T, H, R], [T, 1, R]
            out = self.attn(q_latent, q_pe, latent, k_pe.view(T, self.rope))  # [T, H, L]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(T, self.local_heads * self.v))
