"""What a DeepSeek-V3-family checkpoint adds to ModelConfig: multi-head latent attention (MLAConfig) and
the mixture of experts (MoEConfig), read from a transformers config (`DeepseekV3Config`); Qwen3-MoE's experts
(`Qwen3MoeConfig`) use the same MoEConfig.

Kept apart from engine/config.py so the Llama family's config stays what it was; ModelConfig carries
these as optional fields (None for dense Llama-family models).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from engine.errors import UnsupportedModelError

MLA_ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True, slots=True)
class MLAConfig:
    q_lora_rank: int | None  # None: one q_proj instead of q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int  # the compressed latent each token caches
    qk_nope_head_dim: int  # per-head query/key features without position
    qk_rope_head_dim: int  # the decoupled rotary part: one key shared by every head, cached beside the latent
    v_head_dim: int
    rope_interleave: bool  # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek publishes them
    attention_bias: bool  # q_a_proj, kv_a_proj_with_mqa and o_proj carry biases

    @property
    def cache_width(self) -> int:
        """Elements one token caches per layer: its latent and its rotated rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def softmax_scale(self, rope_scaling: dict | None) -> float:
        """1/sqrt(qk_nope + qk_rope) (the head dim of the expanded form, whatever form runs), times YaRN's
        mscale(factor, mscale_all_dim) squared: the attention sharpening DeepSeek applies on top of the
        rotary table's own factor. Not 1/sqrt(kv_lora_rank + qk_rope), the width the absorbed form dots."""
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if rope_scaling is not None and rope_scaling.get("mscale_all_dim"):
            m = yarn_mscale(rope_scaling["factor"], rope_scaling["mscale_all_dim"])
            scale *= m * m
        return scale


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int  # routed experts
    top_k: int  # experts per token
    intermediate_size: int  # per expert (moe_intermediate_size)
    num_shared_experts: int  # always-on experts, one MLP of num_shared * intermediate_size
    first_dense_layers: int  # first_k_dense_replace: layers before it keep a dense MLP
    n_group: int  # experts are split into n_group groups ...
    topk_group: int  # ... and a token picks its experts from its best topk_group groups only
    routed_scaling_factor: float
    norm_topk_prob: bool
    scoring: str  # "sigmoid" (DeepSeek-V3, with e_score_correction_bias) or "softmax" (Qwen3-MoE)
    sparse_step: int = 1  # every sparse_step-th layer is MoE (Qwen3-MoE's decoder_sparse_step)
    dense_layers: tuple[int, ...] = ()  # layers that keep a dense MLP anyway (Qwen3-MoE's mlp_only_layers)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (layer_idx >= self.first_dense_layers and (layer_idx + 1) % self.sparse_step == 0
                and layer_idx not in self.dense_layers)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_from_hf(hf) -> MLAConfig:
    return MLAConfig(
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        rope_interleave=bool(getattr(hf, "rope_interleave", True)),
        attention_bias=bool(getattr(hf, "attention_bias", False)),
    )


def deepseek_moe_from_hf(hf) -> MoEConfig:
    """DeepSeek-V3 routes one way whatever older fields a config carries (topk_method noaux_tc, sigmoid
    scores with e_score_correction_bias), as transformers' DeepseekV3ForCausalLM does."""
    n_group = getattr(hf, "n_group", None) or 1
    num_experts = hf.n_routed_experts
    if num_experts % n_group:
        raise UnsupportedModelError(f"n_routed_experts={num_experts} is not divisible by n_group={n_group}")
    return MoEConfig(
        num_experts=num_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.moe_intermediate_size,
        num_shared_experts=hf.n_shared_experts or 0,
        first_dense_layers=hf.first_k_dense_replace or 0,
        n_group=n_group,
        topk_group=getattr(hf, "topk_group", None) or n_group,
        routed_scaling_factor=float(hf.routed_scaling_factor),
        norm_topk_prob=bool(hf.norm_topk_prob),
        scoring="sigmoid",
    )


def qwen3_moe_from_hf(hf) -> MoEConfig:
    """Softmax over all experts, top-k, optionally renormalized; no shared experts, no groups, no scaling."""
    return MoEConfig(
        num_experts=hf.num_experts,
        top_k=hf.num_experts_per_tok,
        intermediate_size=hf.moe_intermediate_size,
        num_shared_experts=0,
        first_dense_layers=0,
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=bool(hf.norm_topk_prob),
        scoring="softmax",
        sparse_step=getattr(hf, "decoder_sparse_step", 1) or 1,
        dense_layers=tuple(getattr(hf, "mlp_only_layers", None) or ()),
    )


def rope_params(hf, supported, what: str = "") -> tuple[float, dict | None]:
    """RoPE base and scaling from either transformers layout (v5 `rope_parameters` or v4 fields); a rope type not
    in `supported` is an UnsupportedModelError (`what`: the model kind it names, e.g. " for MLA")."""
    params = getattr(hf, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
    params = dict(params)
    theta = float(params.pop("rope_theta", getattr(hf, "rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in supported:
        raise UnsupportedModelError(f"unsupported rope_type {rope_type!r}{what}; supported: {supported}")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    return theta, params


def mla_rope_params(hf) -> tuple[float, dict | None]:
    """(theta, scaling) of the rotary part (rope_params); YaRN keeps every field the table and the softmax scale
    need, with `factor` made explicit (DeepSeek derives a missing one from max_position_embeddings /
    original_max_position_embeddings, as transformers does)."""
    theta, params = rope_params(hf, MLA_ROPE_TYPES, " for MLA")
    if params is not None and params.get("factor") is None:
        params["factor"] = hf.max_position_embeddings / params["original_max_position_embeddings"]
    return theta, params
