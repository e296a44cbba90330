"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (GQA with per-head q/k norm, engine/models/llama.py)
and mixture-of-experts MLPs (engine/layers/moe.py: softmax over the experts, top-k, optionally renormalized,
no shared experts); layers named by `mlp_only_layers`, or off the `decoder_sparse_step` grid, keep a dense MLP.

Everything but the block's MLP is the Llama family's model; checkpoints name experts one by one
(`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`) and the router `mlp.gate.weight`.
"""
from __future__ import annotations

from torch import nn

from engine.config import ModelConfig
from engine.distributed.data_parallel import DPContext
from engine.distributed.parallel import TPContext
from engine.layers.moe import EXPERT_PARTS, MoEBlock
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.deepseek_v3 import resolve
from engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """LlamaDecoderLayer (its forward and the two halves the piecewise forward uses) with a MoE MLP."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPContext, rotary: RotaryEmbedding,
                 dp: DPContext | None = None):
        nn.Module.__init__(self)  # not LlamaDecoderLayer's: it would build a dense MLP first
        self.self_attn = LlamaAttention(cfg, layer_idx, tp, rotary)
        self.mlp = MoEBlock(cfg.hidden_size, cfg.moe, tp, dp) if cfg.moe.is_moe_layer(layer_idx) else LlamaMLP(cfg, tp, dp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    decoder_layer = Qwen3MoeDecoderLayer

    def param_for(self, ckpt_name: str) -> tuple[nn.Module, str, object] | None:
        """Experts and routers by DeepSeek-V3's rules (the same names); everything else as Llama's."""
        name = ckpt_name.removeprefix("model.")
        if ".mlp.experts." in name or ".mlp.gate." in name:
            return resolve(self, name)
        return super().param_for(ckpt_name)

    def expected_checkpoint_names(self) -> set[str]:
        moe = self.cfg.moe
        names = set()
        for name in super().expected_checkpoint_names():
            layer = name.split(".")[2] if name.startswith("model.layers.") else None
            if layer is not None and ".mlp." in name and moe.is_moe_layer(int(layer)):
                continue  # a MoE layer has no dense MLP
            names.add(name)
        for i in range(self.cfg.num_layers):
            if moe.is_moe_layer(i):
                names.add(f"model.layers.{i}.mlp.gate.weight")
                names.update(f"model.layers.{i}.mlp.experts.{e}.{p}.weight" for e in range(moe.num_experts)
                             for p in EXPERT_PARTS)
        return names
