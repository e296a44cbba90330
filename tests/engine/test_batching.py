"""Batch invariance: a request's tokens do not depend on what else runs with it."""
import random

from engine import LLM, SamplingParams


def _prompts(n, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 380) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


def test_greedy_alone_equals_in_a_batch_of_17(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4, max_num_batched_tokens=96)
    target = [5, 9, 22, 41, 8, 120, 7]
    others = _prompts(16)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = llm.generate([target], params)[0].token_ids
    # Different lengths and max_tokens in the batch; a small budget forces chunked prefills beside decodes.
    mixed_params = [params] + [SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True) for i in range(16)]
    together = llm.generate([target] + others, mixed_params)
    assert together[0].token_ids == alone
    for i, p in enumerate(others[:4]):  # and the others equal their own solo runs
        assert together[1 + i].token_ids == llm.generate([p], mixed_params[1 + i])[0].token_ids


def test_seeded_sampling_is_batch_invariant(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4)
    target = [5, 9, 22, 41, 8, 120, 7]
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = llm.generate([target], params)[0].token_ids
    others = _prompts(16, seed=1)
    other_params = [SamplingParams(max_tokens=10, temperature=0.7, seed=i, ignore_eos=True) for i in range(16)]
    together = llm.generate(others[:7] + [target] + others[7:], other_params[:7] + [params] + other_params[7:])
    assert together[7].token_ids == alone
    # A different seed gives a different sequence (the seed is really used).
    other_seed = llm.generate([target], SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True))[0]
    assert other_seed.token_ids != alone
