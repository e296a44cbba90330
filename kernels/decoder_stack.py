"""A Llama-family decoder's whole few-row CPU forward in one C++ call (kernels/cpu/decoder_stack.cpp,
torch.ops.tandem_cpu.decoder_stack): embedding, every block (RMSNorm, QKV with optional bias, optional q/k norm,
rotary embedding, paged attention with the KV written, output projection, SiLU MLP) and the final norm, on weights
packed by kernels/linear_rows.py (fp32 or bf16), in fp32. The attention reads the step set by
kernels.attention.cpu_attention_step around the call. Needs cpu_ext.available().

engine/models/native_stack.py runs a target's decode forward through it under cpu_compile="full".
"""
from __future__ import annotations

import torch

# Weights per layer, in this order (None where a layer has no such tensor): mirrors Slot in decoder_stack.cpp.
SLOTS = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "post_norm", "gate_up", "gate_up_bias",
         "down", "down_bias")


def decoder_stack(input_ids: torch.Tensor, embed: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor,
                  weights: list[torch.Tensor | None], final_norm: torch.Tensor, layer_ids: list[int], num_heads: int,
                  num_kv_heads: int, head_dim: int, intermediate: int, eps: float, scale: float) -> list[torch.Tensor]:
    """input_ids [T] int64, or the first block's input rows [T, H] fp32 (a draft head's; embed then only gives H);
    embed [V, H] fp32 (any strides); cos2, sin2 [T, 1, R] (kernels/norm_rope.py rope_rows);
    weights: len(SLOTS) per layer, the matrices as pack_rows(W) with W [out, in] (qkv: q, k, v rows stacked; gate_up:
    gate then up rows), norms [H] / [head_dim] fp32; layer_ids: each layer's index into the step's KV cache.
    -> [final normed hidden [T, H], residual stream after the last block [T, H], the stream after each other block]."""
    return torch.ops.tandem_cpu.decoder_stack(input_ids, embed, cos2, sin2, weights, final_norm, layer_ids, num_heads,
                                              num_kv_heads, head_dim, intermediate, eps, scale)
