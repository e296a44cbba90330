"""Small random Qwen3-MoE checkpoints saved by transformers (deterministic), with the tiny tokenizer."""
from __future__ import annotations

import torch

from tests.support.tiny import VOCAB, tiny_tokenizer

# One with renormalized top-k and a dense layer named by mlp_only_layers; one without renormalization where
# every second layer is MoE (decoder_sparse_step 2), GQA 4:1.
VARIANTS = {
    "norm_topk": dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1], num_key_value_heads=2),
    "sparse_step": dict(norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[], num_key_value_heads=1),
}


def make_qwen3_moe_checkpoint(path, variant: str = "norm_topk", seed: int = 0, dtype=torch.float32):
    """Save a random Qwen3-MoE model and the tiny tokenizer in `path`; returns the transformers model."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=4, head_dim=32, num_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2,
                         tie_word_embeddings=False, **VARIANTS[variant])
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # larger weights: well-separated greedy choices
                p.mul_(4.0)
    model.save_pretrained(path)
    tiny_tokenizer(path)
    return model
