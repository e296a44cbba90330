"""kernels/rng.py: the map from 32-bit hashes to uniforms stays strictly inside (0, 1)."""
import torch

from kernels import rng


def test_uniforms_never_reach_0_or_1():
    """Regression: 24 bits as (k + 0.5) / 2**24 rounded to exactly 1.0 in float32 for k = 2**24 - 1, so the
    exponential noise was 0 and a grammar-masked token (probability 0) won argmax(p / E) as 0 / 0 = NaN:
    a sampled guided request emitted a token its grammar forbids (found by
    tests/engine/speculative/test_spec_distribution_guided.py, seed 5241)."""
    edges = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 513, 2**32 - 512, 2**32 - 1], dtype=torch.int64)
    u = rng.unit_interval(edges)
    assert u.dtype == torch.float32
    assert bool(((u > 0) & (u < 1)).all()), u
    noise = -torch.log(u)
    assert bool((torch.isfinite(noise) & (noise > 0)).all())
    top = torch.arange(2**32 - 2**16, 2**32, dtype=torch.int64)  # the whole top of the range
    assert float(rng.unit_interval(top).max()) < 1.0


def test_a_masked_token_never_wins_the_exponential_race():
    probs = torch.zeros(1, 2**12)
    probs[0, 7] = 1.0
    for seed in range(64):
        noise = rng.exponential(torch.tensor([seed]), torch.tensor([3]), probs.shape[1], rng.STREAM_SAMPLE)
        assert int((probs / noise).argmax(-1)) == 7
