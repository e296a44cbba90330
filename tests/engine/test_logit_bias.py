"""OpenAI's logit_bias (SamplingParams.logit_bias) in engine/sample/sampler.py, engine/speculative/proposer.py and
engine/sample/verify.py: added to the logits before the grammar mask and sampling, to the draft's as to
the target's, so that speculative sampling draws from the biased target distribution exactly; the
engine end to end, with and without speculation."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine.errors import InvalidRequestError
from engine.sample.sampler import SamplingBatch, sample
from engine.sample.verify import verify
from engine.sampling_params import SamplingParams
from engine.speculative.proposer import sample_drafts

V = 8


def _batch(n: int, temperature: float, bias: torch.Tensor | None, positions: torch.Tensor | None = None):
    return SamplingBatch(
        temperature=torch.full((n,), temperature), top_k=torch.zeros(n, dtype=torch.int64),
        top_p=torch.ones(n), min_p=torch.zeros(n), seeds=torch.arange(n, dtype=torch.int64),
        positions=torch.zeros(n, dtype=torch.int64) if positions is None else positions,
        all_greedy=temperature == 0, use_top_k=False, use_top_p=False, use_min_p=False, max_logprobs=0,
        logit_bias=None if bias is None else bias.expand(n, V).contiguous())


def test_greedy_sampling_follows_the_bias_and_logprobs_stay_the_raw_models():
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 0.0, 0.0, 0.0, 0.0]])
    plain = sample(logits.clone(), _batch(1, 0.0, None))
    assert plain.token_ids.tolist() == [2]
    bias = torch.zeros(V)
    bias[2], bias[6] = -100.0, 3.5
    biased = sample(logits.clone(), _batch(1, 0.0, bias))
    assert biased.token_ids.tolist() == [6]
    assert biased.logprobs.item() == pytest.approx(logits.log_softmax(-1)[0, 6].item())


def test_a_grammar_mask_still_wins_over_a_positive_bias():
    logits = torch.zeros(1, V)
    bias = torch.zeros(V)
    bias[3] = 100.0

    def allow_only_5(t: torch.Tensor) -> None:
        keep = t[:, 5].clone()
        t.fill_(float("-inf"))
        t[:, 5] = keep

    assert sample(logits, _batch(1, 0.0, bias), allow_only_5).token_ids.tolist() == [5]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_speculative_sampling_draws_from_the_biased_target(temperature):
    """Drafts drawn by sample_drafts from the biased draft distribution, verified by rejection against the
    biased target: the first and second emitted tokens follow softmax((target + bias) / T) exactly (chi-square
    at fixed seeds). Verification is lossless only if q is the distribution each draft was drawn from: both biased."""
    n, k = 6000, 2
    g = torch.Generator().manual_seed(0)
    target = torch.randn(k + 1, V, generator=g) * 1.5  # [k+1, V], the same for every row
    draft = target[:k] + torch.randn(k, V, generator=g)  # close to the target, not equal
    bias = torch.tensor([2.0, -100.0, 0.0, 1.0, -1.5, 0.0, 3.0, -0.5])
    b = _batch(n, temperature, bias, positions=torch.full((n,), 7, dtype=torch.int64))
    drafts, probs = [], []
    for s in range(k):
        token, q = sample_drafts(draft[s].expand(n, V).clone(), b.positions + 1 + s, b, None, V)
        drafts.append(token)
        probs.append(q)
    drafts, probs = torch.stack(drafts, 1), torch.stack(probs, 1)
    assert not (drafts == 1).any()  # -100: never drafted
    out = verify(target.expand(n, k + 1, V).clone(), drafts, torch.full((n,), k), probs, b, full_drafts=True)
    want = ((target[0] + bias) / temperature).softmax(-1).double().numpy()
    counts = np.bincount(out.tokens[:, 0].numpy(), minlength=V)
    assert counts[1] == 0
    keep = want > 1e-9
    expected = want[keep] / want[keep].sum() * counts[keep].sum()
    assert stats.chisquare(counts[keep], expected).pvalue > 1e-3, (counts, want * n)


def test_sampling_params_check_and_normalize_logit_bias():
    assert SamplingParams(logit_bias={"5": 10, 7: -100}).logit_bias == {5: 10.0, 7: -100.0}  # JSON keys too
    for bad in ({"x": 1}, {"-1": 1}, {"5": 101}, {"5": "high"}, [1, 2]):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(logit_bias=bad)
        assert e.value.param == "logit_bias"


def test_the_engine_follows_the_bias_with_and_without_speculation(tiny_model_dir):
    from engine import LLM, SpecConfig

    prompt = [17, 43, 99, 5, 250, 31, 17, 43, 99, 5]
    outs = {}
    for spec in (None, SpecConfig(method="ngram", k=3)):
        llm = LLM(tiny_model_dir, num_kv_blocks=64, speculative=spec)
        plain = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
        avoid = {t: -100.0 for t in set(plain)}
        biased = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True,
                                                       logit_bias=avoid))[0].token_ids
        forced = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True,
                                                       logit_bias={42: 100.0}))[0].token_ids
        assert not set(biased) & set(plain) and forced == [42] * 6
        outs[spec is None] = (plain, biased)
    assert outs[True] == outs[False]  # speculation changes no greedy token, biased or not
