"""Prefix caching in the engine: outputs with the cache equal outputs without it (greedy, seeded, guided,
speculative, under eviction and preemption), the shared prefix is computed once, nothing leaks."""
from __future__ import annotations

import pytest

from engine import LLM, EngineConfig, LLMEngine, SamplingParams, SpecConfig
from structured.request import StructuredOutput

SYSTEM = list(range(5, 5 + 37))  # 37 shared tokens: two full blocks of 16 and a partial third


def _prompts(n: int, tail: int = 6) -> list[list[int]]:
    return [SYSTEM + [(7 * i + j) % 200 + 3 for j in range(tail + i % 3)] for i in range(n)]


def _pair(model: str, **kwargs):
    return (LLM(model, num_kv_blocks=256, block_size=16, enable_prefix_caching=True, **kwargs),
            LLM(model, num_kv_blocks=256, block_size=16, enable_prefix_caching=False, **kwargs))


def _generate_in_turns(llm: LLM, prompts, params) -> list:
    """One prompt first, then the rest: the later ones can hit the first one's blocks."""
    return llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)


def _no_leaks(llm: LLM) -> None:
    pool = llm.engine.blocks.pool
    assert llm.engine.stats()["kv_blocks_used"] == 0
    assert pool.num_free == pool.num_blocks  # cached blocks are all evictable


def test_greedy_outputs_equal_and_the_prefix_is_computed_once(llama_dir):
    cached, plain = _pair(llama_dir)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts(5)
    a = _generate_in_turns(cached, prompts, params)
    b = _generate_in_turns(plain, prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    stats = cached.engine.stats()["prefix_cache"]
    assert stats["hit_tokens"] == 4 * 32  # four later prompts reuse the system prompt's two full blocks
    assert plain.engine.stats()["prefix_cache"] is None
    _no_leaks(cached)


def test_seeded_sampling_is_unchanged(llama_dir):
    cached, plain = _pair(llama_dir)
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    prompts = _prompts(4)
    assert ([o.token_ids for o in _generate_in_turns(cached, prompts, params)]
            == [o.token_ids for o in _generate_in_turns(plain, prompts, params)])


def test_a_repeated_prompt_reuses_its_own_answer_blocks(llama_dir):
    """Multi-turn chat: the next turn's prompt is the last prompt plus its answer."""
    cached, plain = _pair(llama_dir)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    first = cached.generate([SYSTEM], params)[0]
    turn2 = SYSTEM + first.token_ids + [9, 10, 11]
    before = cached.engine.stats()["prefix_cache"]["hit_tokens"]
    assert cached.generate([turn2], params)[0].token_ids == plain.generate([turn2], params)[0].token_ids
    assert cached.engine.stats()["prefix_cache"]["hit_tokens"] - before == 48  # 61 tokens: 3 full blocks reused


def test_guided_outputs_are_unchanged(llama_dir):
    cached, plain = _pair(llama_dir)
    params = SamplingParams(max_tokens=20, temperature=0,
                            structured_output=StructuredOutput(regex="[a-c]{3,8}"))
    prompts = _prompts(3)
    assert ([o.token_ids for o in _generate_in_turns(cached, prompts, params)]
            == [o.token_ids for o in _generate_in_turns(plain, prompts, params)])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_speculation_is_unchanged_acceptance_included(zoo_dir, method):
    """The draft head's KV is cached with the target's: a request that reuses a block drafts exactly as one
    that computed it (equal acceptance), not only the same tokens (lossless either way)."""
    from pathlib import Path

    root = Path(zoo_dir)
    spec = SpecConfig(method=method, k=3, draft=str(root / method))
    cached, plain = _pair(str(root / "target"), speculative=spec)
    params = SamplingParams(max_tokens=24, temperature=0)
    prompts = _prompts(4, tail=10)
    a = _generate_in_turns(cached, prompts, params)
    b = _generate_in_turns(plain, prompts, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert cached.engine.stats()["prefix_cache"]["hit_tokens"] > 0
    assert (cached.engine.stats()["spec"]["accepted_length_hist"]
            == plain.engine.stats()["spec"]["accepted_length_hist"])
    _no_leaks(cached)


def test_eviction_and_preemption_keep_outputs_and_free_every_block(llama_dir):
    """A cache so small that cached blocks are evicted and refilled mid-run and requests preempt each other."""
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    prompts = _prompts(8)
    outs = {}
    for enabled in (True, False):
        engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=14, block_size=8, max_num_seqs=6,
                                        max_num_batched_tokens=64, enable_prefix_caching=enabled))
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        done = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        outs[enabled] = [done[f"r{i}"].token_ids for i in range(len(prompts))]
        if enabled:
            assert sum(o.metrics.num_preemptions for o in done.values()) > 0, "the test must preempt"
            assert engine.blocks.pool.num_evicted > 0, "the test must evict cached blocks"
            assert engine.stats()["kv_blocks_used"] == 0
            assert engine.blocks.pool.num_free == 14
    assert outs[True] == outs[False]


def test_requests_arriving_together_compute_their_shared_prefix_once(llama_dir):
    """Sent in one batch (nothing cached yet), the later ones wait for the first one's prefix blocks and reuse them."""
    cached, plain = _pair(llama_dir)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    system = [(11 * i) % 190 + 5 for i in range(150)]  # 9 full blocks: long enough to wait for (MIN_WAIT_TOKENS)
    prompts = [system + p[len(SYSTEM):] for p in _prompts(4)]
    assert [o.token_ids for o in cached.generate(prompts, params)] == [o.token_ids for o in plain.generate(prompts, params)]
    stats = cached.engine.stats()["prefix_cache"]
    assert stats["hit_tokens"] == 3 * 144 and stats["deferred_admissions"] >= 3
    _no_leaks(cached)
