"""Test support: one embedded Ray per test session, shared by every test package that needs it.

Each test folder's conftest imports `ray_session`. Pytest then holds one fixture per folder, so the
fixture counts its users: the first starts Ray, the last (at session end) shuts it down.
"""
from __future__ import annotations

import os
import tempfile

import pytest

from cluster.runtime import RayOptions, init_ray, shutdown_ray

_users = 0
TEST_NUM_CPUS = int(os.environ.get("TANDEM_TEST_RAY_CPUS", "8"))  # logical: actors mostly wait


@pytest.fixture(scope="session")
def ray_session():
    global _users
    import ray

    if _users == 0 and not ray.is_initialized():
        temp_dir = tempfile.mkdtemp(prefix="tandem-ray-")
        init_ray(RayOptions(num_cpus=TEST_NUM_CPUS, object_store_memory=128 * 2**20, temp_dir=temp_dir,
                            log_to_driver=True))
    _users += 1
    yield ray
    _users -= 1
    if _users == 0:
        shutdown_ray()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def build_tiny_llama(path, seed: int = 0, num_kv_heads: int = 2, vocab: int = 384, hidden: int = 64,
                     layers: int = 2, heads: int = 4, max_positions: int = 256) -> str:
    """A small random Llama (weights scaled so greedy choices are well separated) with a byte-level BPE
    tokenizer and a chat template; deterministic for a seed. Stands in until the zoo's tiny target."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.testing import save_tiny_tokenizer

    text = ["The quick brown fox jumps over the lazy dog. Tandem serves models on Ray.",
            "def add(a, b):\n    return a + b\n", "Grüße aus Köln, naïve café, 東京", "Hello, how are you?"] * 20
    save_tiny_tokenizer(path, vocab, text, CHAT_TEMPLATE)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(4.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
