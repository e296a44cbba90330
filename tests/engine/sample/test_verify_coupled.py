"""Coupled verification (engine/sample/verify.py) and coupled drafts (engine/speculative/proposer.py) against a
reference written here: the plain sampler's draw at every chain position, and the longest prefix of drafts
equal to those draws. Pins issue 35's premise: a seeded request's token at a position does not depend on
whether it was checked as a draft, drawn after a mismatch or drawn plainly."""
from dataclasses import replace

import pytest
import torch

from engine.sample.sampler import SamplingBatch, sample
from engine.sample.verify import verify
from engine.speculative.proposer import sample_drafts


def batch(temperature: torch.Tensor, coupled: torch.Tensor | None, top_k: int = 0, top_p: float = 1.0,
          seed0: int = 11) -> SamplingBatch:
    n = temperature.numel()
    return SamplingBatch(
        temperature=temperature, top_k=torch.full((n,), top_k, dtype=torch.int64), top_p=torch.full((n,), top_p),
        min_p=torch.zeros(n), seeds=torch.arange(seed0, seed0 + n, dtype=torch.int64),
        positions=torch.arange(n, dtype=torch.int64) * 7 + 3, all_greedy=bool((temperature == 0).all()),
        use_top_k=top_k > 0, use_top_p=top_p < 1.0, use_min_p=False, max_logprobs=None, coupled=coupled)


def plain_draws(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """[B, k+1]: what the sampler alone draws at each chain position, one position at a time."""
    return torch.stack([sample(logits[:, j], replace(b, positions=b.positions + j)).token_ids
                        for j in range(logits.shape[1])], 1)


def reference(draws: torch.Tensor, drafts: torch.Tensor, num_drafts: list[int]) -> tuple[list, list]:
    tokens, accepted = [], []
    for row, d, n in zip(draws.tolist(), drafts.tolist(), num_drafts):
        a = 0
        while a < n and d[a] == row[a]:
            a += 1
        tokens.append(d[:a] + [row[a]] + [-1] * (len(d) - a))
        accepted.append(a)
    return tokens, accepted


def drafts_near(draws: torch.Tensor, V: int, g: torch.Generator) -> torch.Tensor:
    """[B, k] drafts equal to the draws up to a random row-dependent point, then wrong: every accepted
    length from 0 to k occurs."""
    B, k1 = draws.shape
    k = k1 - 1
    wrong_from = torch.arange(B) % (k + 1)
    wrong = (draws[:, :k] + 1 + torch.randint(0, V - 1, (B, k), generator=g)) % V
    return torch.where(torch.arange(k)[None, :] >= wrong_from[:, None], wrong, draws[:, :k])


@pytest.mark.parametrize("k,V,top_k,top_p", [(1, 37, 0, 1.0), (3, 50, 0, 1.0), (4, 37, 9, 0.9), (2, 101, 0, 0.8)])
def test_coupled_rows_emit_the_plain_draws(k, V, top_k, top_p):
    g = torch.Generator().manual_seed(k * 100 + V)
    B = 2 * (k + 1) + 1
    logits = torch.randn(B, k + 1, V, generator=g) * 2
    temperature = torch.tensor([0.0 if i % 5 == 4 else 0.7 + 0.1 * (i % 4) for i in range(B)])
    b = batch(temperature, torch.ones(B, dtype=torch.bool), top_k, top_p)
    draws = plain_draws(logits, b)
    drafts = drafts_near(draws, V, g)
    q = torch.rand(B, k, V, generator=g).softmax(-1)  # the draft distributions do not matter to coupled rows
    got = verify(logits, drafts, torch.full((B,), k), q, b, full_drafts=True)
    tokens, accepted = reference(draws, drafts, [k] * B)
    assert got.tokens.tolist() == tokens
    assert got.num_accepted.tolist() == accepted
    assert sorted(set(accepted)) == list(range(k + 1))


def test_fewer_drafts_than_k_end_at_the_plain_draw():
    """A request with n < k drafts (prompt lookup, the end of max_tokens) gets the draw at P + n after them."""
    g = torch.Generator().manual_seed(3)
    B, k, V = 6, 3, 41
    logits = torch.randn(B, k + 1, V, generator=g)
    b = batch(torch.full((B,), 0.9), torch.ones(B, dtype=torch.bool))
    draws = plain_draws(logits, b)
    drafts = draws[:, :k].clone()  # every draft right: only the count cuts acceptance
    num_drafts = [0, 1, 2, 3, 1, 0]
    got = verify(logits, drafts, torch.tensor(num_drafts), None, b, full_drafts=False)
    tokens, accepted = reference(draws, drafts, num_drafts)
    assert got.num_accepted.tolist() == accepted == num_drafts
    assert got.tokens.tolist() == tokens


def test_uncoupled_rows_keep_rejection_sampling_in_a_mixed_batch():
    g = torch.Generator().manual_seed(5)
    B, k, V = 9, 3, 30
    logits = torch.randn(B, k + 1, V, generator=g) * 2
    coupled = torch.tensor([i % 2 == 0 for i in range(B)])
    b = batch(torch.full((B,), 1.0), coupled)
    draws = plain_draws(logits, b)
    drafts = drafts_near(draws, V, g)
    q = torch.rand(B, k, V, generator=g).softmax(-1)
    mixed = verify(logits, drafts, torch.full((B,), k), q, b, full_drafts=True)
    rejection = verify(logits, drafts, torch.full((B,), k), q, replace(b, coupled=None), full_drafts=True)
    tokens, accepted = reference(draws, drafts, [k] * B)
    for i in range(B):
        want = (tokens[i], accepted[i]) if coupled[i] else (rejection.tokens[i].tolist(),
                                                             int(rejection.num_accepted[i]))
        assert (mixed.tokens[i].tolist(), int(mixed.num_accepted[i])) == want
    # the two rules differ somewhere on these rows, or the mixed batch would test nothing
    assert rejection.tokens[coupled].tolist() != [tokens[i] for i in range(B) if coupled[i]]


@pytest.mark.parametrize("mapped", [False, True])
def test_a_draft_with_the_targets_distribution_is_the_targets_draw(mapped):
    """Coupled drafts race on the target's own numbers: a draft network whose q equals p drafts exactly
    the token the target draws there (a reduced vocabulary: at the mapped target ids)."""
    g = torch.Generator().manual_seed(7)
    B, V = 12, 64
    logits = torch.randn(B, V, generator=g) * 2
    d2t = torch.arange(0, V, 3) if mapped else None  # the draft's vocabulary: every third target id
    if mapped:
        outside = torch.ones(V, dtype=torch.bool)
        outside[d2t] = False
        logits[:, outside] = float("-inf")  # a target whose support lies in the map
    temperature = torch.tensor([0.0, 0.6, 1.0, 1.3] * 3)
    b = batch(temperature, torch.ones(B, dtype=torch.bool), top_k=10)
    draft_logits = logits[:, d2t] if mapped else logits
    drafts, q = sample_drafts(draft_logits, b.positions, b, d2t, V)
    assert drafts.tolist() == sample(logits, b).token_ids.tolist()
    assert q.shape == (B, V)
