"""Test support: one embedded Ray per test session, shared by every test package that needs it, a tiny
checkpoint, and bounded waits on events (tests assert events, never wall-clock limits).

tests/conftest.py imports `ray_session`; the fixture counts its users (a conftest of its own elsewhere
would make a second fixture): the first starts Ray, the last (at session end) shuts it down.
"""
from __future__ import annotations

import os
import tempfile
import threading
import time
from typing import Callable, TypeVar

import pytest

_users = 0
T = TypeVar("T")
TEST_NUM_CPUS = int(os.environ.get("TANDEM_TEST_RAY_CPUS", "8"))  # logical: actors mostly wait
# The one test node is every kind of node deploy/cluster.yaml has, so deploy/serve.yaml's placement
# (prefill_resources, rank_resources, router_resources) runs unchanged in tests (tests/integration).
NODE_KINDS = {"tandem_head": 64, "tandem_prefill": 64, "tandem_decode": 64}


@pytest.fixture(scope="session")
def ray_session():
    global _users
    # Imported here, not at the top: a GPU node given only the engine's packages (no Ray; docs/serving.md,
    # "Tests on GPUs") still collects and runs the engine and kernel tests through tests/conftest.py.
    import ray

    from cluster.runtime import RayOptions, init_ray, shutdown_ray

    if _users == 0 and not ray.is_initialized():
        temp_dir = tempfile.mkdtemp(prefix="tandem-ray-")
        init_ray(RayOptions(num_cpus=TEST_NUM_CPUS, object_store_memory=128 * 2**20, temp_dir=temp_dir,
                            log_to_driver=True, resources=NODE_KINDS))
    _users += 1
    yield ray
    _users -= 1
    if _users == 0:
        shutdown_ray()


# Tests wait for events, never assert wall-clock limits: the machine is shared and slow at times. These
# bounds only turn a hang into a failure that says what never happened.
def wait_for(condition: Callable[[], T], what: str, timeout_s: float = 120.0, poll_s: float = 0.05) -> T:
    """Poll `condition` until it returns something truthy, and return that; AssertionError naming `what`
    if it never does within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f}s (last seen: {value!r})")
        time.sleep(poll_s)


def returns(fn: Callable[[], T], what: str, timeout_s: float = 120.0) -> T:
    """`fn()` run on a thread: its result, or what it raised; AssertionError naming `what` if it hangs."""
    done: dict = {}

    def _run():
        try:
            done["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            done["error"] = e

    t = threading.Thread(target=_run, daemon=True, name=f"returns-{what}")
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise AssertionError(f"{what}: still blocked after {timeout_s:.0f}s")
    if "error" in done:
        raise done["error"]
    return done["value"]


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
    # 1024 positions: room for a tool-calling prompt (the tools preamble) plus a call (tests/router/test_tools_http.py)
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), max_positions=1024)
