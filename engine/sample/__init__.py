"""Tokens from logits, inside the device step: sampling with temperature, top-k/top-p/min-p, penalties
and logit bias, its noise keyed by (seed, position) so it is batch invariant (`sampler`), and the
verification of drafted tokens, greedy match or lossless rejection sampling (`verify`).

Never imports the models, the runner, the scheduler, masking, the proposers or structured/: it takes
logits and per-request parameters as tensors and returns tokens.
"""
