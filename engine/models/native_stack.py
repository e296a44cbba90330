"""A Llama-family target's whole few-row CPU forward as one C++ call (kernels/cpu/decoder_stack.cpp), for
EngineConfig.cpu_compile="full".

The inductor graph of a whole forward (engine/models/piecewise.py) runs its matmuls and attentions as C++ ops
already, but through a Python wrapper of ~270 calls per step and an OpenMP region per fused elementwise kernel:
~3 ms of a 15-17 ms SmolLM2 batch-1 step beyond the matmuls (bench/results/real_decode_native_cpu.md). The op runs
the same forward in C++ on the same streamed weights (engine/layers/streamed_gemm.py) and the same attention op.
PiecewiseForward uses it for a bucket when it serves the model and agrees with the eager forward on the bucket's
probe; otherwise the inductor graph stays.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.layers.streamed_gemm import StreamedGemm
from kernels.decoder_stack import SLOTS, decoder_stack


def native_target(model) -> Callable | None:
    """fn(input_ids, cos2, sin2) -> (final normed hidden, residual stream after the last block, the streams after
    each other block): target_pieces' whole-graph outputs. None where the op does not serve `model`: not the plain
    Llama block (MoE blocks, another family's), not fp32, sharded, the C++ kernels off, or a matmul not streamed."""
    from engine.models.llama import LlamaDecoderLayer, LlamaMLP
    from kernels import cpu_ext

    if not cpu_ext.available() or getattr(model, "dp", None) is not None:
        return None
    layers = list(model.layers)
    if not layers or any(type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP for layer in layers):
        return None
    embed = model.embed_tokens.weight
    if embed.dtype != torch.float32 or embed.device.type != "cpu":
        return None
    weights: list[torch.Tensor | None] = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(not isinstance(lin.packed, StreamedGemm) for lin in linears):
            return None
        if any(getattr(lin, "tp", None) is not None and lin.tp.size != 1 for lin in linears):
            return None
        weights += [layer.input_layernorm.weight, attn.qkv_proj.packed.pack, attn.qkv_proj.bias,
                    attn.q_norm.weight if attn.q_norm is not None else None,
                    attn.k_norm.weight if attn.k_norm is not None else None,
                    attn.o_proj.packed.pack, attn.o_proj.bias, layer.post_attention_layernorm.weight,
                    mlp.gate_up_proj.packed.pack, mlp.gate_up_proj.bias, mlp.down_proj.packed.pack, mlp.down_proj.bias]
    assert len(weights) == len(SLOTS) * len(layers)
    if any(w is not None and w.dim() == 1 and w.dtype != torch.float32 for w in weights):
        return None
    first = layers[0].self_attn
    cfg = model.cfg
    layer_ids = [layer.self_attn.attn.layer_idx for layer in layers]
    args = (model.norm.weight, layer_ids, first.attn.num_heads, first.attn.num_kv_heads, first.attn.head_dim,
            layers[0].mlp.gate_up_proj.packed.n // 2, float(cfg.rms_norm_eps), float(first.attn.scale))

    def run(input_ids: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(decoder_stack(input_ids, embed, cos2, sin2, weights, *args))

    return run
