"""Small random checkpoints saved by transformers (deterministic), one per supported architecture, with the
tiny byte-level BPE tokenizer beside them so that text prompts and stop strings work."""
from __future__ import annotations

import torch

from tests.support.tiny import VOCAB, tiny_tokenizer

ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def _config(arch: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if arch == "llama":
        return LlamaConfig(**common, tie_word_embeddings=False)
    if arch == "llama3":  # Llama-3 RoPE scaling, tied embeddings, GQA 4:1
        return LlamaConfig(**{**common, "num_key_value_heads": 1}, tie_word_embeddings=True,
                           rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                            "rope_theta": 500000.0})
    if arch == "mistral":
        return MistralConfig(**common, sliding_window=4096, tie_word_embeddings=False)
    if arch == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    raise ValueError(arch)


def make_checkpoint(path, arch: str, seed: int = 0, dtype=torch.float32, max_shard_size=None):
    """Save a random `arch` model (one of ARCHS) and the tiny tokenizer in `path`; returns the transformers
    model, in `dtype`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(arch)).to(dtype).eval()
    # Random init gives near-uniform logits; larger weights make greedy choices well separated.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    tiny_tokenizer(path)
    return model
