"""Sampling with draft trees (engine/speculative/tree_verify.py): seeded requests bit for bit the engine without
speculation (penalties, min_tokens, top-p too), and the first two tokens of unseeded requests against the exact
distributions (chi-square), with the first verification accepting more often than a chain's single draft."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, SpecConfig
from tests.support.distribution import fits

pytestmark = pytest.mark.slow

N = 3000


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _tree(zoo: Path, method: str = "mtp") -> SpecConfig:
    return SpecConfig(method=method, k=3, draft=str(zoo / method), topk=3, num_verify_tokens=8)


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_seeded_tree_sampling_equals_no_speculation(zoo, json_prompts, method):
    params = [SamplingParams(max_tokens=32, temperature=t, top_p=p, seed=s, **extra)
              for s, (t, p, extra) in enumerate([(1.0, 1.0, dict(ignore_eos=True)), (0.8, 0.9, dict(ignore_eos=True)),
                                                 (1.0, 1.0, dict(repetition_penalty=1.3, frequency_penalty=0.5)),
                                                 (0.7, 1.0, dict(min_tokens=20))])]
    plain = LLM(str(zoo / "target"), num_kv_blocks=1024, block_size=16)
    want = [o.token_ids for o in plain.generate(json_prompts[:4], params)]
    llm = LLM(str(zoo / "target"), num_kv_blocks=1024, block_size=16, speculative=_tree(zoo, method))
    outs = llm.generate(json_prompts[:4], params)
    assert [o.token_ids for o in outs] == want
    assert sum(sum(o.metrics.accepted_lengths) - len(o.metrics.accepted_lengths) for o in outs) > 0


@pytest.fixture(scope="module")
def prompt(zoo, json_prompts) -> list[int]:
    """A schema prompt's first 24 tokens, cut inside the schema's first key: a broad next-token distribution, and a
    short prompt keeps the exact second-token distribution (a forward per first token) and N prefills cheap."""
    llm = LLM(str(zoo / "target"), num_kv_blocks=64, block_size=16)
    return llm.engine.tokenizer.encode(json_prompts[0])[:24]


@pytest.fixture(scope="module")
def exact(zoo, prompt):
    """The exact distributions of the first and second tokens [V] at temperature 1 (transformers)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(zoo / "target"), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = hf(torch.tensor([prompt])).logits[0, -1].float().softmax(-1).double()
        support = torch.nonzero(p1 > 1e-9)[:, 0]  # the second token matters only after a first that occurs
        p2 = torch.zeros_like(p1)
        for chunk in support.split(256):
            rows = torch.tensor([prompt + [int(t)] for t in chunk])
            p2 += p1[chunk] @ hf(rows).logits[:, -1].float().softmax(-1).double()
    return p1, p2


def _first_two(llm: LLM, prompt: list[int]):
    params = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)  # room for two depth-1 nodes
    outs = llm.generate([prompt] * N, [params] * N)
    tokens = np.array([o.token_ids[:2] for o in outs])
    first_accepted = np.mean([o.metrics.accepted_lengths[0] > 1 for o in outs])
    return tokens[:, 0], tokens[:, 1], first_accepted


def test_unseeded_tree_sampling_follows_the_target(zoo, prompt, exact):
    kw = dict(num_kv_blocks=N * 2, block_size=16, max_num_seqs=512, max_num_batched_tokens=8192)
    llm = LLM(str(zoo / "target"), speculative=_tree(zoo), **kw)
    first, second, tree_rate = _first_two(llm, prompt)
    p1, p2 = exact
    assert fits(first, p1) > 1e-3
    assert fits(second, p2) > 1e-3
    chain = LLM(str(zoo / "target"), speculative=SpecConfig(method="mtp", k=3, draft=str(zoo / "mtp")), **kw)
    _, _, chain_rate = _first_two(chain, prompt)
    assert tree_rate > chain_rate, (tree_rate, chain_rate)  # siblings catch what the first draft misses
