"""Sampling with speculation draws from the target's distribution: the first and second generated
tokens of many requests, with and without speculation, against the exact distributions
computed from transformers (chi-square goodness of fit at fixed seeds). Requests with a seed are verified
by coupling, those without by rejection sampling (engine/sample/verify.py): both are checked."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams, SpecConfig
from tests.support.distribution import PROMPT, fits

N = 3000


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _processed(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.softmax(-1).double()


@pytest.fixture(scope="module")
def exact(checkpoints):
    """(temperature, top_k) -> exact distributions of the first and second tokens [V] each."""
    _, hf = checkpoints["llama"]
    memo = {}

    def get(temperature: float, top_k: int):
        if (temperature, top_k) not in memo:
            with torch.no_grad():
                p1 = _processed(hf(torch.tensor([PROMPT])).logits[0, -1].float(), temperature, top_k)
                V = p1.numel()
                both = torch.tensor([PROMPT + [t] for t in range(V)])
                p2_given = _processed(hf(both).logits[:, -1].float(), temperature, top_k)  # [V(t1), V(t2)]
            memo[(temperature, top_k)] = (p1, p1 @ p2_given)
        return memo[(temperature, top_k)]

    return get


def _sample(llm: LLM, temperature: float, top_k: int, seeded: bool):
    # max_tokens 3: the second token is then verified against one draft (the room left for drafts).
    params = [SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=1000 + i if seeded else None,
                             ignore_eos=True) for i in range(N)]
    outs = llm.generate([PROMPT] * N, params)
    tokens = np.array([o.token_ids for o in outs])
    return tokens[:, 0], tokens[:, 1], [o.metrics for o in outs]


@pytest.mark.parametrize("method,temperature,top_k,seeded", [
    (None, 1.0, 0, True), ("eagle3", 1.0, 0, True), ("draft_model", 1.0, 0, True), ("mtp", 1.0, 0, True),
    ("ngram", 1.0, 0, True), ("draft_model", 0.8, 20, True), ("mtp_token_map", 1.0, 0, True),
    ("draft_model", 1.0, 0, False), ("draft_model", 0.8, 20, False), ("mtp_token_map", 1.0, 0, False),
])
def test_first_and_second_tokens_follow_the_target(llama_dir, spec_drafts, near_draft, exact, method, temperature,
                                                   top_k, seeded, tmp_path):
    """mtp_token_map: the head drafts from half the vocabulary (engine/speculative/token_map.py), so its
    draft distribution is zero on the other half: verification must still give the target's."""
    drafts = {**spec_drafts, "draft_model": near_draft, "mtp_token_map": spec_drafts["mtp"]}
    token_map = None
    if method == "mtp_token_map":
        token_map = tmp_path / "map.json"
        token_map.write_text(json.dumps(list(range(0, exact(temperature, top_k)[0].numel(), 2))))
    spec = None if method is None else SpecConfig(method=method.removesuffix("_token_map"), k=3, draft=drafts[method],
                                                  token_map=None if token_map is None else str(token_map))
    llm = LLM(llama_dir, num_kv_blocks=N * 5, block_size=4, max_num_seqs=512, max_num_batched_tokens=4096,
              speculative=spec)
    first, second, metrics = _sample(llm, temperature, top_k, seeded)
    p1, p2 = exact(temperature, top_k)
    assert fits(first, p1) > 1e-3
    assert fits(second, p2) > 1e-3
    verified = [m for m in metrics if m.num_draft_tokens]  # second token verified against a draft
    if method in ("eagle3", "mtp", "draft_model", "mtp_token_map"):
        assert len(verified) == N
    elif method == "ngram":
        assert verified  # (prompt lookup finds the first token in the prompt only sometimes)
    if method == "draft_model":  # verification both accepted and rejected first drafts
        accepted = sum(m.accepted_lengths[0] > 1 for m in metrics)
        assert N // 10 < accepted < N - N // 10, accepted
