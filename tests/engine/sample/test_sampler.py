"""engine/sample/sampler.py against plain-torch references written here."""
import numpy as np
import pytest
import torch
from scipy import stats

from engine.core.request import Request
from engine.sample.sampler import SamplingBatch, SamplingMode, apply_penalties, build_sampling, processed_logits, sample
from engine.sampling_params import SamplingParams


def batch(n, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seeds=None, positions=None, logprobs=None, **pen):
    t = torch.full((n,), float(temperature)) if not isinstance(temperature, torch.Tensor) else temperature
    return SamplingBatch(
        temperature=t, top_k=torch.full((n,), top_k, dtype=torch.int64), top_p=torch.full((n,), float(top_p)),
        min_p=torch.full((n,), float(min_p)),
        seeds=seeds if seeds is not None else torch.arange(n, dtype=torch.int64),
        positions=positions if positions is not None else torch.zeros(n, dtype=torch.int64),
        all_greedy=bool((t == 0).all()), use_top_k=top_k > 0, use_top_p=top_p < 1.0, use_min_p=min_p > 0,
        max_logprobs=logprobs, **pen)


def ref_filter(logits, top_k, top_p, min_p):
    """Row by row, the textbook definitions."""
    out = logits.clone()
    for r in range(logits.shape[0]):
        row = out[r]
        if top_k:
            kth = row.topk(top_k).values[-1]
            row[row < kth] = float("-inf")
        if top_p < 1:
            p = row.softmax(-1)
            sp, idx = p.sort(descending=True)
            keep = (sp.cumsum(0) - sp) < top_p
            keep[0] = True
            mask = torch.ones_like(row, dtype=torch.bool)
            mask[idx[keep]] = False
            row[mask] = float("-inf")
        if min_p:
            p = row.softmax(-1)
            row[p < min_p * p.max()] = float("-inf")
    return out


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (7, 0.9, 0.05), (1, 1.0, 0.0)])
def test_filters_match_reference(top_k, top_p, min_p):
    torch.manual_seed(0)
    logits = torch.randn(6, 37) * 3
    got = processed_logits(logits, batch(6, 1.0, top_k, top_p, min_p))
    ref = ref_filter(logits, top_k, top_p, min_p)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    torch.testing.assert_close(got[~torch.isinf(got)], ref[~torch.isinf(ref)])


def test_greedy_rows_take_argmax_in_a_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    temp = torch.tensor([0.0, 1.0] * 4)
    out = sample(logits, batch(8, temperature=temp))
    assert torch.equal(out.token_ids[::2], logits.argmax(-1)[::2])


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.8)])
def test_sampled_distribution_matches_processed_probs(temperature, top_k, top_p):
    torch.manual_seed(2)
    V, n = 10, 20000
    logits = torch.randn(1, V).repeat(n, 1)
    b = batch(n, temperature, top_k, top_p, seeds=torch.arange(n, dtype=torch.int64) * 7919)
    tokens = sample(logits, b).token_ids
    probs = processed_logits(logits[:1], batch(1, temperature, top_k, top_p)).softmax(-1)[0]
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[probs == 0].sum() == 0
    keep = probs > 0
    expected = probs[keep].double() / probs[keep].double().sum() * n
    chi = stats.chisquare(counts[keep].numpy(), expected.numpy())
    assert chi.pvalue > 1e-3, chi


def test_seed_and_position_determine_the_draw():
    torch.manual_seed(3)
    logits = torch.randn(4, 1000)
    seeds = torch.tensor([5, 6, 5, 5])
    pos = torch.tensor([10, 10, 10, 11])
    t1 = sample(logits[[0, 0, 0, 0]], batch(4, seeds=seeds, positions=pos)).token_ids
    t2 = sample(logits[[0]], batch(1, seeds=seeds[:1], positions=pos[:1])).token_ids
    assert t1[0] == t2[0] == t1[2]  # same (seed, position): same token whatever the batch


def test_penalties_match_reference():
    torch.manual_seed(4)
    V = 20
    logits = torch.randn(2, V)
    prompt = [[1, 2, 3], [4]]
    output = [[3, 3, 5], [6, 6, 6, 4]]
    counts = torch.zeros(2, V)
    seen = torch.zeros(2, V, dtype=torch.bool)
    for i in range(2):
        for t in output[i]:
            counts[i, t] += 1
        seen[i, prompt[i] + output[i]] = True
    b = batch(2, repetition=torch.tensor([1.3, 0.8]), presence=torch.tensor([0.5, -0.2]),
              frequency=torch.tensor([0.1, 0.4]), output_counts=counts, seen_mask=seen)
    got = apply_penalties(logits, b)
    ref = logits.clone()
    for i, (rep, pres, freq) in enumerate([(1.3, 0.5, 0.1), (0.8, -0.2, 0.4)]):
        for t in set(prompt[i] + output[i]):
            ref[i, t] = ref[i, t] / rep if ref[i, t] > 0 else ref[i, t] * rep
        for t in set(output[i]):
            ref[i, t] -= pres + freq * output[i].count(t)
    torch.testing.assert_close(got, ref)


def test_logprobs_are_raw_model_logprobs():
    torch.manual_seed(5)
    logits = torch.randn(3, 30)
    out = sample(logits, batch(3, temperature=torch.zeros(3), logprobs=4))
    lp = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprobs, lp.gather(-1, out.token_ids[:, None])[:, 0])
    torch.testing.assert_close(out.top_logprobs, lp.topk(4).values)
    assert torch.equal(out.top_ids[:, 0], logits.argmax(-1))


_MODE_PARAMS = {
    "greedy": SamplingParams(temperature=0.0),
    "greedy_seeded": SamplingParams(temperature=0.0, seed=3),
    "sampled": SamplingParams(),
    "seeded": SamplingParams(seed=5),
    "top_k": SamplingParams(top_k=4),
    "top_k_whole_vocab": SamplingParams(top_k=50),  # top_k >= V filters nothing: no top-k branch
    "top_p": SamplingParams(top_p=0.9),
    "min_p": SamplingParams(min_p=0.1),
    "greedy_top_p": SamplingParams(temperature=0.0, top_p=0.5),  # filters of a greedy row take no branch
    "logprobs": SamplingParams(temperature=0.0, logprobs=3),
    "penalty": SamplingParams(temperature=0.0, presence_penalty=0.5),
    "bias": SamplingParams(temperature=0.0, logit_bias={2: 5.0}),
    "min_tokens": SamplingParams(temperature=0.0, min_tokens=4),
}


@pytest.mark.parametrize("names", [("greedy",), ("greedy_seeded",), ("sampled", "greedy"), ("seeded", "greedy"),
                                   ("top_k",), ("top_k_whole_vocab",), ("top_p", "min_p"), ("greedy_top_p",),
                                   ("logprobs", "sampled"), ("penalty",), ("bias", "greedy"),
                                   ("min_tokens",), ("min_tokens_done",), tuple(_MODE_PARAMS)])
def test_sampling_mode_of_requests_is_the_built_batch_mode(names):
    """SamplingMode.of (what an ADP group agrees on before building a batch) names the branches build_sampling
    takes for the same requests, padded or not: a mismatch would make ranks replay different graphs."""
    vocab = 50
    requests = []
    for i, name in enumerate(names):
        params = _MODE_PARAMS.get(name, SamplingParams(temperature=0.0, min_tokens=2))
        req = Request(f"r{i}", [1, 2, 3], params, seed=7, max_total_tokens=64,
                      min_tokens_block=(0,) if params.min_tokens else ())
        if name == "min_tokens_done":  # wrote its min_tokens: nothing is blocked any more
            req.token_ids += [4, 5]
        requests.append(req)
    mode = SamplingMode.of(requests, vocab)
    for size in (len(requests), len(requests) + 3):
        built = build_sampling(requests, np.zeros(size, dtype=np.int64), size, torch.device("cpu"), vocab)
        assert built.mode == mode, (names, size)
