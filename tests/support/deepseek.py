"""Small random DeepSeek-V3 checkpoints saved by transformers (deterministic), with the tiny tokenizer: MLA
with YaRN, a dense first layer, then MoE layers with group-limited routing and a shared expert."""
from __future__ import annotations

import torch

from tests.support.tiny import VOCAB, tiny_tokenizer

# Two variants: q through a low-rank projection (DeepSeek-V3) with mscale = mscale_all_dim (the rotary table's
# attention factor is 1), and one q_proj (q_lora_rank null, as DeepSeek-V2-Lite) with mscale != mscale_all_dim.
VARIANTS = {
    "q_lora": dict(q_lora_rank=48, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}),
    "no_q_lora": dict(q_lora_rank=None, rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 0.8, "rope_theta": 50000.0}),
}


def deepseek_config(variant: str = "q_lora", **overrides):
    from transformers import DeepseekV3Config

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, qk_rope_head_dim=8,
                  v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                  first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    fields.update(VARIANTS[variant])
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def make_deepseek_checkpoint(path, variant: str = "q_lora", seed: int = 0, dtype=torch.float32, **overrides):
    """Save a random DeepSeek-V3 model and the tiny tokenizer in `path`; returns the transformers model."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_config(variant, **overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # larger weights: well-separated greedy choices
                p.mul_(4.0)
        for name, b in model.named_buffers():
            # transformers starts the routing correction at zero; a trained model's is not
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape) * 0.5)
    model.save_pretrained(path)
    tiny_tokenizer(path)
    return model
