"""Small random checkpoints saved by transformers inside the test session (deterministic), one per
architecture, plus a tiny byte-level BPE tokenizer so that text prompts and stop strings work."""
from __future__ import annotations

import pytest
import torch

VOCAB = 384


def _tokenizer(path):
    from engine.testing import save_tiny_tokenizer

    text = ["The quick brown fox jumps over the lazy dog. {\"name\": \"Ada\", \"age\": 36}",
            "def add(a, b):\n    return a + b\n", "Grüße aus Köln, naïve café, 東京"] * 20
    return save_tiny_tokenizer(path, VOCAB, text)


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


ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def make_checkpoint(path, arch: str, seed: int = 0, dtype=torch.float32, max_shard_size=None):
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
    _tokenizer(path)
    return model


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """arch -> (model dir, transformers model in fp32)."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch in ARCHS:
        path = root / arch
        out[arch] = (str(path), make_checkpoint(path, arch))
    return out


@pytest.fixture(scope="session")
def llama_dir(checkpoints):
    return checkpoints["llama"][0]


@pytest.fixture(scope="module")
def one_thread_module():
    """Tiny models: intra-op threads only add synchronization, and on a shared CPU they spin."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def grammar_tokenizer(tmp_path_factory):
    """The tiny tokenizer (VOCAB ids) for grammar tests; id 1 ends a guided output."""
    return _tokenizer(tmp_path_factory.mktemp("grammar_tok"))


@pytest.fixture(scope="session")
def grammar_compiler(grammar_tokenizer):
    from engine.grammar import GrammarCompiler

    return GrammarCompiler(grammar_tokenizer, VOCAB, [1])


def closing_bias(tokenizer, closers: str, weight: float, also: tuple[int, ...] = ()):
    """Logit bias favouring the tokens that hold one of `closers` (and the ids in `also`), so random
    walks through a free-form grammar end within their step budget."""
    import torch

    return torch.tensor([weight if any(c in tokenizer.decode([t]) for c in closers) or t in also else 0.0
                         for t in range(VOCAB)])


def walk_json(compiler, tokenizer, spec, seed: int, max_steps: int = 300, bias=None):
    """walk_tokens ending on the stop token (id 1), its text parsed as JSON."""
    import json

    out, token = walk_tokens(compiler, spec, seed, max_steps, bias)
    assert token == 1, token
    return json.loads(tokenizer.decode(out))


def walk_tokens(compiler, spec, seed: int, max_steps: int = 300, bias=None) -> tuple[list[int], int]:
    """Greedy decoding of random logits under the grammar mask (any backend's compiler) until the matcher
    terminates: (the tokens before the last, the last), which ended it; AssertionError if it never does."""
    import torch

    from kernels.bitmask import apply_token_bitmask

    state = compiler.new_state(compiler.compile(spec), spec)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(max_steps):
        logits = torch.randn(1, VOCAB, generator=g)
        if bias is not None:
            logits += bias
        mask = compiler.allocate_bitmask(1)
        state.fill_bitmask(mask, 0)
        apply_token_bitmask(logits, mask)
        token = int(logits.argmax())
        assert state.accept(token)
        if state.terminated:
            return out, token
        out.append(token)
    raise AssertionError("grammar did not terminate")


def assert_backend_writes_valid(compiler, tokenizer, schema: dict, backend: str, closers: str,
                                max_steps: int = 300, seeds: int = 8) -> None:
    """Random walks through `schema`'s grammar on `backend` each end in an instance valid against it.
    For llguidance, a keyword xgrammar does not enforce (multipleOf on a number) is added to send the
    schema there; skipped where llguidance is not installed."""
    import jsonschema
    import pytest

    from engine import grammar_llguidance as llg
    from engine.grammar import StructuredOutput

    if backend == "llguidance":
        if not llg.available():
            pytest.skip("llguidance is not installed")
        schema = {**schema, "properties": {**schema["properties"], "w": {"type": "number", "multipleOf": 0.5}}}
    spec = StructuredOutput(json_schema=schema)
    assert spec.plan.backend == backend
    bias = closing_bias(tokenizer, closers, 2.0)
    for seed in range(seeds):
        jsonschema.validate(walk_json(compiler, tokenizer, spec, seed, max_steps=max_steps, bias=bias), schema)
