"""Tokens from logits, inside the device step: sampling with temperature, top-k/top-p/min-p, penalties
and logit bias, its noise keyed by (seed, position) so it is batch invariant (`sampler`), and the
verification of drafted tokens (`verify`): greedy match, coupling (a seeded request's draft is accepted iff it
is the sampler's own draw there) or lossless rejection sampling.

Never imports the models, the runner, the scheduler, masking, the proposers or structured/: it takes
logits and per-request parameters as tensors and returns tokens.
"""
