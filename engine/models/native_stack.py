"""A Llama-family target's whole few-row CPU forward as one C++ call (kernels/cpu/decoder_stack.cpp), for
EngineConfig.cpu_compile="full".

The inductor graph of a whole forward (engine/models/piecewise.py) runs its matmuls and attentions as C++ ops
already, but through a Python wrapper of ~270 calls per step and an OpenMP region per fused elementwise kernel:
~3 ms of a 15-17 ms SmolLM2 batch-1 step beyond the matmuls (bench/results/real_decode_native_cpu.md). The op runs
the same forward in C++ on the same streamed weights (engine/layers/streamed_gemm.py) and the same attention op.
PiecewiseForward uses it for a bucket when it serves the model and agrees with the eager forward on the bucket's
probe; otherwise the inductor graph stays. An MTP head's block runs through the same op (native_mtp), its first
block's input given as rows rather than token ids.
"""
from __future__ import annotations

from typing import Callable

import torch

from engine.layers.streamed_gemm import StreamedGemm
from kernels.decoder_stack import SLOTS, decoder_stack


def _stack(layers: list, final_norm: torch.Tensor, cfg, embed: torch.Tensor, dp) -> Callable | None:
    """fn(first block's input: ids [T] or rows [T, H], cos2, sin2) -> decoder_stack's outputs over `layers`, or None
    where the op does not serve them (see native_target)."""
    from engine.models.llama import LlamaDecoderLayer, LlamaMLP
    from kernels import cpu_ext

    if not cpu_ext.available() or dp is not None:
        return None
    if not layers or any(type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP for layer in layers):
        return None
    if embed.dtype != torch.float32 or embed.device.type != "cpu" or final_norm.dtype != torch.float32:
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
    layer_ids = [layer.self_attn.attn.layer_idx for layer in layers]
    args = (final_norm, layer_ids, first.attn.num_heads, first.attn.num_kv_heads, first.attn.head_dim,
            layers[0].mlp.gate_up_proj.packed.n // 2, float(cfg.rms_norm_eps), float(first.attn.scale))

    def run(inputs: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> list[torch.Tensor]:
        return decoder_stack(inputs, embed, cos2, sin2, weights, *args)

    return run


def native_target(model) -> Callable | None:
    """fn(input_ids, cos2, sin2) -> (final normed hidden, residual stream after the last block, the streams after
    each other block): target_pieces' whole-graph outputs. None where the op does not serve `model`: not the plain
    Llama block (MoE blocks, another family's), not fp32, sharded, the C++ kernels off, or a matmul not streamed."""
    run = _stack(list(model.layers), model.norm.weight, model.cfg, model.embed_tokens.weight,
                 getattr(model, "dp", None))
    if run is None:
        return None
    return lambda input_ids, cos2, sin2: tuple(run(input_ids, cos2, sin2))


def native_mtp(head) -> Callable | None:
    """fn(hidden, token_ids, cos2, sin2) -> (the head's normed state,): mtp_pieces' whole-graph output, its block
    through the same C++ op as the target's (the graph's Python wrapper cost ~0.4 ms of each ~0.9 ms head pass in a
    SmolLM2 MTP step). Its input projection, eh_proj(cat(enorm(embed(token)), hnorm(hidden))), stays in torch: two
    norms of a few rows and one streamed matmul. None where the op does not serve the head (as native_target)."""
    from engine.layers.norm import RMSNorm

    if not isinstance(getattr(head.eh_proj, "packed", None), StreamedGemm):
        return None
    if any(type(norm) is not RMSNorm for norm in (head.enorm, head.hnorm, head.shared_head.norm)):
        return None
    run = _stack([head.block], head.shared_head.norm.weight, head.cfg, head.embed_tokens.weight, None)
    if run is None:
        return None

    def forward(hidden: torch.Tensor, token_ids: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor):
        x = torch.cat([head.enorm(head.embed_tokens(token_ids)), head.hnorm(hidden)], dim=-1)
        return (run(head.eh_proj(x).float(), cos2, sin2)[0],)

    return forward
