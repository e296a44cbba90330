"""vLLM's min_tokens (SamplingParams.min_tokens): EOS and the request's stop_token_ids cannot be sampled
while the output is shorter, in the sampler and in each position of speculative verification; the engine
end to end with and without speculation, against the tiny model pushed towards stopping by a logit bias."""
from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.sample.sampler import SamplingBatch, sample
from engine.sample.verify import verify
from engine.sampling_params import SamplingParams

V = 8
EOS = 1


def _batch(n: int, left: list[int]) -> SamplingBatch:
    block = torch.zeros(n, V, dtype=torch.bool)
    block[:, EOS] = True
    return SamplingBatch(
        temperature=torch.zeros(n), top_k=torch.zeros(n, dtype=torch.int64), top_p=torch.ones(n),
        min_p=torch.zeros(n), seeds=torch.arange(n, dtype=torch.int64), positions=torch.zeros(n, dtype=torch.int64),
        all_greedy=True, use_top_k=False, use_top_p=False, use_min_p=False, max_logprobs=None,
        early_stop_block=block, min_tokens_left=torch.tensor(left, dtype=torch.int64))


def test_the_sampler_holds_eos_back_while_the_output_is_short():
    logits = torch.zeros(2, V)
    logits[:, EOS], logits[:, 4] = 5.0, 1.0
    assert sample(logits.clone(), _batch(2, [1, 0])).token_ids.tolist() == [4, EOS]


def test_verification_holds_eos_back_position_by_position():
    """A chain of k+1 positions: EOS is blocked at the positions still short of min_tokens only."""
    k = 3
    logits = torch.zeros(2, k + 1, V)
    logits[..., EOS], logits[..., 4] = 5.0, 1.0
    drafts = torch.full((2, k), 4, dtype=torch.int64)
    out = verify(logits, drafts, torch.full((2,), k), None, _batch(2, [2, 0]), full_drafts=True)
    assert out.tokens[0].tolist() == [4, 4, EOS, -1]  # positions 0 and 1 are short: drafts accepted there
    assert out.tokens[1].tolist() == [EOS, -1, -1, -1]


def test_sampling_params_check_min_tokens():
    assert SamplingParams(max_tokens=8, min_tokens=8).min_tokens == 8
    for bad in ({"min_tokens": -1}, {"min_tokens": 9}, {"min_tokens": 2, "structured_output": {"regex": "a+"}}):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(max_tokens=8, **bad)
        assert e.value.param == "min_tokens"


@pytest.mark.parametrize("stop", ["eos", "stop_token_ids"])
def test_the_engine_writes_min_tokens_before_it_stops(tiny_model_dir, stop):
    from engine import LLM, SpecConfig

    prompt = [17, 43, 99, 5, 250, 31, 17, 43, 99, 5]
    ender = 1 if stop == "eos" else 42  # the tiny model's EOS is id 1
    extra = {} if stop == "eos" else {"stop_token_ids": [ender]}
    for spec in (None, SpecConfig(method="ngram", k=3)):
        llm = LLM(tiny_model_dir, num_kv_blocks=64, speculative=spec)
        pushed = SamplingParams(max_tokens=20, temperature=0, logit_bias={ender: 30.0}, **extra)
        assert len(llm.generate([prompt], pushed)[0].token_ids) <= 1  # it would stop at once
        for min_tokens in (1, 5):
            out = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0, logit_bias={ender: 30.0},
                                                        min_tokens=min_tokens, **extra))[0]
            assert out.finish_reason == "stop", (spec, min_tokens)
            body = [t for t in out.token_ids if t != ender]
            assert len(body) == min_tokens and ender not in out.token_ids[:min_tokens]
