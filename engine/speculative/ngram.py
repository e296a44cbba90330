"""Prompt lookup (n-gram) drafts: no model, proposed on the host after each step.

The last n tokens of a request (n from `max_n` down to `min_n`) are searched for earlier in its
prompt and output; the tokens that followed the most recent earlier occurrence are the drafts.
Drafts are deterministic functions of the tokens so far, so verifying them by matching the
target's own draws (greedy or seeded) gives exactly the tokens of a run without speculation.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k drafts continuing `token_ids`, or [] when no suffix n-gram occurred before."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    L = tokens.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        suffix = tokens[L - n:]
        # Windows starting at 0..L-n-1: every earlier occurrence, excluding the suffix itself.
        windows = sliding_window_view(tokens[: L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
