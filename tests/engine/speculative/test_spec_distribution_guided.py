"""Sampled guided decoding keeps the target's MASKED distribution with speculation on (issue 11): the
first and second tokens of many seeded guided requests, with and without speculation (draft masks on),
against the exact masked softmax computed from transformers and the grammar's own masks, and spec
against no-spec directly (two-sample chi-square). Unseeded requests too: theirs are verified by rejection
sampling, seeded ones by coupling (engine/sample/verify.py). The unguided version is test_spec_distribution.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine import LLM, SamplingParams, SpecConfig, StructuredOutput
from tests.support.distribution import PROMPT, fits
from tests.support.tiny import VOCAB

N = 2000
# letters and spaces, at least 16 characters: no two tokens of the tiny tokenizer complete it, so
# every request writes 3 tokens and the grammar admits many tokens at each of the first two positions
GUIDE = StructuredOutput(regex="[a-z ]{16,24}")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _allowed(state, compiler) -> torch.Tensor:
    """[V] bool: the tokens the grammar admits next."""
    bitmask = compiler.allocate_bitmask(1)
    state.fill_bitmask(bitmask, 0)
    bits = (bitmask[0].to(torch.int64).unsqueeze(1) >> torch.arange(32)) & 1  # [W, 32]
    return bits.flatten()[:VOCAB].bool()


def _masked(logits: torch.Tensor, allowed: torch.Tensor, temperature: float) -> torch.Tensor:
    return (logits / temperature).masked_fill(~allowed, float("-inf")).softmax(-1).double()


@pytest.fixture(scope="module")
def exact_masked(checkpoints):
    """temperature -> the exact masked distributions of the first and second tokens [V] each."""
    from structured.compiler import GrammarCompiler
    from transformers import AutoTokenizer

    path, hf = checkpoints["llama"]
    compiler = GrammarCompiler(AutoTokenizer.from_pretrained(path), VOCAB, stop_token_ids=[1], compile_timeout_s=None)
    compiled = compiler.compile(GUIDE)
    memo = {}

    def get(temperature: float):
        if temperature not in memo:
            state = compiler.new_state(compiled)
            with torch.no_grad():
                p1 = _masked(hf(torch.tensor([PROMPT])).logits[0, -1].float(), _allowed(state, compiler), temperature)
                first = p1.nonzero().flatten().tolist()
                logits2 = hf(torch.tensor([PROMPT + [t] for t in first])).logits[:, -1].float()
            p2 = torch.zeros(VOCAB, dtype=torch.float64)
            for row, t in enumerate(first):
                assert state.accept(t)
                allowed = _allowed(state, compiler)
                assert not allowed[1], "the grammar could end after two tokens: the test's premise"
                p2 += p1[t] * _masked(logits2[row], allowed, temperature)
                state.rollback(1)
            memo[temperature] = (p1, p2)
        return memo[temperature]

    return get


def _sample(llm: LLM, temperature: float, seeded: bool = True):
    params = [SamplingParams(max_tokens=3, temperature=temperature, seed=5000 + i if seeded else None,
                             structured_output=GUIDE) for i in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    tokens = np.array([o.token_ids for o in outs])
    assert tokens.shape == (N, 3)
    return tokens[:, 0], tokens[:, 1], [o.metrics for o in outs]


def _same_distribution(a: np.ndarray, b: np.ndarray) -> float:
    """p-value of a two-sample chi-square (contingency) test; tokens seen fewer than 10 times pooled."""
    ca, cb = np.bincount(a, minlength=VOCAB), np.bincount(b, minlength=VOCAB)
    big = (ca + cb) >= 10
    table = np.array([np.append(ca[big], ca[~big].sum()), np.append(cb[big], cb[~big].sum())])
    table = table[:, table.sum(0) > 0]
    return stats.chi2_contingency(table).pvalue


@pytest.fixture(scope="module")
def no_spec_samples(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=N * 5, block_size=4, max_num_seqs=512, max_num_batched_tokens=4096)
    return _sample(llm, 1.0)


def test_guided_no_spec_follows_the_masked_target(no_spec_samples, exact_masked):
    first, second, _ = no_spec_samples
    p1, p2 = exact_masked(1.0)
    assert (p1 > 0).sum() > 20 and (p2 > 0).sum() > 20  # many tokens allowed: a real test of the shape
    assert fits(first, p1) > 1e-3
    assert fits(second, p2) > 1e-3


@pytest.mark.parametrize("method,seeded", [("draft_model", True), ("eagle3", True), ("mtp", True),
                                           ("draft_model", False)])
def test_guided_spec_keeps_the_masked_distribution(llama_dir, spec_drafts, near_draft, exact_masked,
                                                   no_spec_samples, method, seeded):
    drafts = {**spec_drafts, "draft_model": near_draft}
    llm = LLM(llama_dir, num_kv_blocks=N * 5, block_size=4, max_num_seqs=512, max_num_batched_tokens=4096,
              speculative=SpecConfig(method=method, k=3, draft=drafts[method]))
    first, second, metrics = _sample(llm, 1.0, seeded)
    p1, p2 = exact_masked(1.0)
    assert fits(first, p1) > 1e-3
    assert fits(second, p2) > 1e-3  # the second token was verified against a (masked) draft
    assert sum(bool(m.num_draft_tokens) for m in metrics) == N
    assert _same_distribution(second, no_spec_samples[1]) > 1e-3
    if method == "draft_model":  # verification both accepted and rejected first drafts
        accepted = sum(m.accepted_lengths[0] > 1 for m in metrics)
        assert N // 10 < accepted < N - N // 10, accepted
