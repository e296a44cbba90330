"""The chi-square check that sampled tokens follow an exact distribution, and the prompt the distribution
tests sample after."""
from __future__ import annotations

import numpy as np
import torch
from scipy import stats

PROMPT = [17, 43, 99, 5, 250, 31, 17, 43, 99, 5]  # repeats, so that prompt lookup drafts something


def fits(samples: np.ndarray, probs: torch.Tensor) -> float:
    """p-value of a chi-square test; bins with expected count < 5 are pooled into one."""
    counts = np.bincount(samples, minlength=probs.numel()).astype(float)
    expected = probs.numpy() * len(samples)
    assert counts[expected == 0].sum() == 0, "a token with probability 0 was emitted"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    return stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
