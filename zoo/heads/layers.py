"""Llama building blocks for the draft heads, named as in HF Llama checkpoints.

Same math as transformers' Llama (RMSNorm in float32, rotate-half RoPE, SwiGLU, GQA) with two
additions the heads need:
- attention whose input width can differ from the model width (EAGLE-3 reads 2H-wide inputs);
- "training-time test" attention: the head is unrolled k steps in parallel over every position of a
  sequence. Step 0 attends causally over the step-0 keys; step s > 0 at index i (sequence position
  i + s) attends to the step-0 keys at indices <= i plus the keys of steps 1..s at index i only,
  which is exactly what a k-token draft chain sees at inference (its own earlier drafts and the
  head's cache of the accepted prefix).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for `positions` [B, T] -> two [B, 1, T, head_dim] tensors."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[:, None], emb.sin()[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Llama attention (q/k/v/o_proj, no bias) over `in_features`-wide inputs, with a TTT cache."""

    def __init__(self, in_features: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, rope_theta: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(in_features, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(in_features, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: list) -> torch.Tensor:
        """x [B, T, in_features], positions [B, T]; `cache` collects this step's (k, v) per step."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = rope_cos_sin(positions, self.head_dim, self.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)  # [B, heads, T, head_dim]
        v = v.repeat_interleave(groups, dim=1)
        cache.append((k, v))
        if len(cache) == 1:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = self._ttt_attention(q, cache)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def _ttt_attention(self, q: torch.Tensor, cache: list) -> torch.Tensor:
        scale = self.head_dim ** -0.5
        k0, v0 = cache[0]
        t = q.shape[2]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        prefix = (q @ k0.transpose(-1, -2)) * scale  # [B, heads, T, T]
        prefix = prefix.masked_fill(~causal, float("-inf"))
        chain = torch.stack([(q * k).sum(-1) for k, _ in cache[1:]], dim=-1) * scale  # [B, heads, T, s]
        weights = torch.softmax(torch.cat((prefix, chain), dim=-1).float(), dim=-1).to(q.dtype)
        out = weights[..., :t] @ v0
        chain_v = torch.stack([v for _, v in cache[1:]], dim=-2)  # [B, heads, T, s, head_dim]
        return out + (weights[..., t:, None] * chain_v).sum(-2)


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_theta_of(config: dict) -> float:
    """rope theta from a Llama config dict (transformers 5 `rope_parameters` or legacy `rope_theta`)."""
    params = config.get("rope_parameters") or {}
    return float(params.get("rope_theta", config.get("rope_theta", 10000.0)))


def init_linear_(module: nn.Module, std: float, generator: torch.Generator) -> None:
    """Normal(0, std) for every Linear weight, drawn in parameter order from `generator`."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            with torch.no_grad():
                sub.weight.normal_(0.0, std, generator=generator)
