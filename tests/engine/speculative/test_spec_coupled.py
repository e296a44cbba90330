"""Seeded sampling with a model's drafts is bit for bit the sampling without speculation (coupled verification,
engine/sample/verify.py), whatever the drafting schedule: every draft method, several k, batches mixing
greedy, seeded and unseeded requests, and preemption by recompute on a small KV cache.

Regression for the bug issue 35 found: verified by rejection sampling, a seeded request's token at a position
depended on whether that position was checked as a draft, drawn after a rejection or drawn plainly (as the
first token after a preemption is), so a small cache changed seeded outputs."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams, SpecConfig
from tests.support.spec import random_prompts


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def mixed_params(n: int, max_tokens: int = 16) -> list[SamplingParams]:
    """Seeded sampling at several temperatures and filters, greedy, and unseeded sampling (rejection
    sampling: its output is not compared) in one batch; lengths differ so the batch shrinks."""
    out = []
    for i in range(n):
        length = max_tokens - i % 5
        if i % 4 == 1:
            out.append(SamplingParams(max_tokens=length, temperature=0, ignore_eos=True))
        elif i % 4 == 3:
            out.append(SamplingParams(max_tokens=length, temperature=1.0, ignore_eos=True))
        else:
            out.append(SamplingParams(max_tokens=length, temperature=(0.7, 1.0, 1.3)[i % 3], top_k=(0, 20)[i % 2],
                                      top_p=(1.0, 0.9)[i % 3 == 2], seed=300 + i, ignore_eos=True))
    return out


def compared(params: list[SamplingParams], outs) -> list[list[int]]:
    """Every greedy or seeded output (None for the unseeded ones)."""
    return [o.token_ids if p.greedy or p.seed is not None else None for p, o in zip(params, outs)]


@pytest.fixture(scope="module")
def plain(llama_dir):
    """The engine without speculation: (prompts, params) -> its outputs, memoized."""
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4)
    memo = {}

    def get(n: int, seed: int):
        if (n, seed) not in memo:
            params = mixed_params(n)
            memo[(n, seed)] = compared(params, llm.generate(random_prompts(n, seed), params))
        return memo[(n, seed)]

    return get


def spec(method: str, k: int, spec_drafts: dict, near_draft: str, llama_dir: str) -> SpecConfig:
    """mtp / eagle3: random heads (drafts mostly wrong); near_draft: a draft model close to the target (drafts
    often right); self_draft: the target drafting for itself (every seeded draft is the target's own draw)."""
    if method == "self_draft":
        return SpecConfig("draft_model", k, llama_dir)
    if method == "near_draft":
        return SpecConfig("draft_model", k, near_draft)
    return SpecConfig(method, k, spec_drafts[method])


@pytest.mark.parametrize("method,k", [("mtp", 1), ("mtp", 3), ("eagle3", 2), ("eagle3", 4), ("draft_model", 3),
                                      ("near_draft", 2), ("near_draft", 4), ("self_draft", 3)])
def test_seeded_outputs_equal_no_speculation(llama_dir, spec_drafts, near_draft, plain, method, k):
    params = mixed_params(11)
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4, speculative=spec(method, k, spec_drafts, near_draft, llama_dir))
    outs = llm.generate(random_prompts(11, seed=6), params)
    assert compared(params, outs) == plain(11, 6)
    if method == "self_draft":  # q = p and the same numbers: every seeded draft is the target's draw
        seeded = [o.metrics for p, o in zip(params, outs) if p.seed is not None]
        assert all(m.num_accepted_tokens == m.num_draft_tokens > 0 for m in seeded)


@pytest.mark.parametrize("method,k", [("mtp", 3), ("eagle3", 4), ("near_draft", 3)])
def test_seeded_outputs_survive_preemption(llama_dir, spec_drafts, near_draft, plain, method, k):
    """Too few blocks for everyone's chains: requests are preempted and recomputed, and the token after each
    recompute is drawn plainly; a seeded output is still the one without speculation."""
    params = mixed_params(10)
    llm = LLM(llama_dir, num_kv_blocks=36, block_size=4, speculative=spec(method, k, spec_drafts, near_draft, llama_dir))
    outs = llm.generate(random_prompts(10, seed=8), params)
    assert sum(o.metrics.num_preemptions for o in outs) > 0, "the test must preempt"
    assert compared(params, outs) == plain(10, 8)
    assert llm.engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("method", ["mtp", "eagle3", "near_draft"])
def test_a_continuation_resumes_the_seeded_output(llama_dir, spec_drafts, near_draft, method):
    """Issue 35's resumption: prompt + the tokens emitted so far, sent again with the same seed and the rest
    of the budget, continues with exactly the tokens the uninterrupted request wrote (its positions are the
    same; the drafting schedule is not)."""
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4, speculative=spec(method, 3, spec_drafts, near_draft, llama_dir))
    prompts = random_prompts(4, seed=12)
    whole = [SamplingParams(max_tokens=24, temperature=0.9, seed=70 + i, ignore_eos=True) for i in range(4)]
    full = [o.token_ids for o in llm.generate(prompts, whole)]
    cut = [3, 7, 10, 1]
    rest = [SamplingParams(max_tokens=24 - c, temperature=0.9, seed=70 + i, ignore_eos=True) for i, c in enumerate(cut)]
    resumed = llm.generate([p + f[:c] for p, f, c in zip(prompts, full, cut)], rest)
    assert [f[:c] + o.token_ids for f, c, o in zip(full, cut, resumed)] == full


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_zoo_heads_keep_seeded_outputs_and_accept(zoo_dir, method):
    """The zoo's trained heads: seeded outputs equal the target's alone, on a large and on a small (preempting)
    cache, and the coupled drafts are accepted (random heads give a mean accepted length of about 1.0)."""
    target = str(Path(zoo_dir) / "target")
    prompts = random_prompts(12, seed=11)
    params = [SamplingParams(max_tokens=32, temperature=0.8, seed=40 + i, ignore_eos=True) for i in range(12)]
    want = [o.token_ids for o in LLM(target, num_kv_blocks=1024, block_size=8).generate(prompts, params)]
    draft = SpecConfig(method, 3, str(Path(zoo_dir) / method))
    for blocks in (1024, 40):
        llm = LLM(target, num_kv_blocks=blocks, block_size=8, max_num_seqs=12, speculative=draft)
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == want, f"{blocks} blocks"
        if blocks == 40:
            assert sum(o.metrics.num_preemptions for o in outs) > 0, "the test must preempt"
        else:
            assert llm.engine.stats()["spec"]["mean_accepted_length"] > 1.3
