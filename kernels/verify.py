"""Speculative verification with fixed output shapes and no host sync: greedy and lossless rejection.

Outputs, for B requests with k drafts each:
  output_token_ids [B, k+1] int64: the accepted drafts, then one bonus/corrected token, then -1;
  accepted_len [B] int32: accepted drafts (emitted tokens = accepted_len + 1).

Rejection sampling (Leviathan et al.; Chen et al.): p = target distribution after temperature,
top-k and top-p; q = draft distribution (one-hot on the draft token when `draft_probs` is None).
Draft x_j is accepted when u * q_j(x) < p_j(x), i.e. with probability min(1, p/q); the first
rejection samples from normalize(max(0, p_j - q_j)); when all k are accepted, a bonus token is
sampled from p_k. Randomness is kernels/rng.py, keyed by (seed, sequence position, stream): the
token at position P = positions[b] + j uses STREAM_ACCEPT element 0 for its test, and the
exponential race argmax(dist / Exp) over vocab indices on STREAM_RESIDUAL (after a rejection) or
STREAM_SAMPLE (bonus). The Triton path reproduces these numbers bit for bit.
"""
import torch

from kernels import rng
from kernels import _verify_triton as _tr
from kernels._dispatch import use_triton
from kernels._launch import on_gpu


def _emit(draft_token_ids, accepted_len, last_token) -> torch.Tensor:
    """[B, k+1]: drafts before accepted_len, last_token at accepted_len, -1 after."""
    B, k = draft_token_ids.shape
    j = torch.arange(k + 1, device=draft_token_ids.device)[None, :]
    n = accepted_len.long()[:, None]
    drafts = torch.cat([draft_token_ids, draft_token_ids.new_full((B, 1), -1)], 1)
    return torch.where(j < n, drafts, torch.where(j == n, last_token[:, None], -1))


# ------------------------------------------------------------------------------------------- greedy


def verify_greedy_ref(
    target_logits: torch.Tensor,  # [B, k+1, V]
    draft_token_ids: torch.Tensor,  # [B, k] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    target = target_logits.argmax(-1)  # [B, k+1]
    match = target[:, :-1] == draft_token_ids
    accepted_len = match.to(torch.int32).cumprod(1).sum(1, dtype=torch.int32)
    last = target.gather(1, accepted_len.long()[:, None])[:, 0]
    return _emit(draft_token_ids, accepted_len, last), accepted_len


def verify_greedy_triton(target_logits, draft_token_ids, chunk: int | None = None):
    return _tr.verify_greedy(target_logits, draft_token_ids, chunk)


def verify_greedy(target_logits, draft_token_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest prefix of drafts equal to the target argmax; emit the argmax after it."""
    fn = verify_greedy_triton if use_triton(target_logits) else verify_greedy_ref
    return fn(target_logits, draft_token_ids)


# ------------------------------------------------------------------------------- target processing


def target_probs(
    target_logits: torch.Tensor,  # [B, J, V]
    temperature: torch.Tensor,  # [B] float32, 0 = greedy (one-hot on the argmax)
    top_k: torch.Tensor,  # [B] int32, 0 or >= V = off
    top_p: torch.Tensor,  # [B] float32, >= 1 = off
    has_filters: bool | None = None,
) -> torch.Tensor:  # [B, J, V] float32
    """The distribution p that sampling draws from; shared by both paths so their p is identical.

    Top-k keeps logits >= the k-th largest; top-p then keeps, on the renormalized top-k
    distribution, every token whose strictly-more-probable mass is < top_p. Both are thresholds on
    the logit, so tied tokens are kept or dropped together. `has_filters=False` (a host fact the
    caller knows from the batch's sampling params) skips the sort; None checks on CPU and assumes
    True on CUDA, where checking would sync.
    """
    B, J, V = target_logits.shape
    greedy = temperature <= 0
    logits = target_logits.float() / torch.where(greedy, 1.0, temperature.float())[:, None, None]
    if has_filters is None:
        has_filters = on_gpu(logits) or bool(((top_k > 0) & (top_k < V)).any() | (top_p < 1).any())
    if has_filters:
        k = top_k.long()
        k = torch.where((k <= 0) | (k >= V), V, k)[:, None, None].expand(B, J, 1)
        sorted_logits = logits.sort(-1, descending=True).values
        rank = torch.arange(V, device=logits.device)
        sorted_p = sorted_logits.masked_fill(rank >= k, float("-inf")).softmax(-1)
        mass_before = torch.cumsum(sorted_p, -1)
        mass_before = torch.cat([torch.zeros_like(mass_before[..., :1]), mass_before[..., :-1]], -1)
        keep = (mass_before < top_p.float()[:, None, None]).sum(-1, keepdim=True).clamp_(min=1)
        keep = torch.minimum(torch.where((top_p >= 1)[:, None, None], V, keep), k)
        threshold = sorted_logits.gather(-1, keep - 1)
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    # Greedy rows keep only their (first) argmax, so softmax returns an exact one-hot. (On CPU the
    # pass is skipped when no row is greedy: reading a flag there costs no device sync.)
    if on_gpu(logits) or bool(greedy.any()):
        top = target_logits.argmax(-1, keepdim=True)
        not_top = torch.arange(V, device=logits.device) != top  # [B, J, V]
        logits = logits.masked_fill_(not_top & greedy[:, None, None], float("-inf"))
    return logits.softmax(-1)


# ----------------------------------------------------------------------------- rejection sampling


def verify_rejection_ref(
    target_logits: torch.Tensor,  # [B, k+1, V]
    draft_token_ids: torch.Tensor,  # [B, k] int64
    draft_probs: torch.Tensor | None,  # [B, k, V] float32, None = one-hot on the draft token
    temperature: torch.Tensor,  # [B] float32
    top_k: torch.Tensor,  # [B] int32
    top_p: torch.Tensor,  # [B] float32
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B] int64, sequence position of the first of the k+1 tokens
    has_filters: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    p = target_probs(target_logits, temperature, top_k, top_p, has_filters)
    return rejection_from_probs_ref(p, draft_token_ids, draft_probs, seeds, positions)


def rejection_from_probs_ref(p, draft_token_ids, draft_probs, seeds, positions):
    """Rejection sampling given the processed target distribution p [B, k+1, V] float32."""
    B, k1, V = p.shape
    k = k1 - 1
    dev = p.device
    seeds, positions = seeds.long(), positions.long()
    x = draft_token_ids.long()
    px = p[:, :k].gather(-1, x[..., None])[..., 0]  # [B, k]
    qx = torch.ones_like(px) if draft_probs is None else draft_probs.float().gather(-1, x[..., None])[..., 0]
    pos = positions[:, None] + torch.arange(k, device=dev)  # [B, k]
    key = rng.hash_key(seeds[:, None].expand(B, k), pos, rng.STREAM_ACCEPT)
    u = rng.uniform_from_key(key, torch.zeros_like(key))
    accepted = u * qx < px
    accepted_len = accepted.to(torch.int32).cumprod(1).sum(1, dtype=torch.int32)

    # Only the position after the last accepted draft needs a full-vocab draw.
    n = accepted_len.long()
    rejected = n < k
    p_n = p.gather(1, n[:, None, None].expand(B, 1, V))[:, 0]  # [B, V]
    if k == 0:
        residual = p_n
    elif draft_probs is None:
        residual = p_n.scatter(-1, x.gather(1, n.clamp(max=k - 1)[:, None]), 0.0)
    else:
        q_n = draft_probs.float().gather(1, n.clamp(max=k - 1)[:, None, None].expand(B, 1, V))[:, 0]
        residual = (p_n - q_n).clamp_min(0.0)
    residual = torch.where((residual > 0).any(-1, keepdim=True), residual, p_n)  # numerical guard
    dist = torch.where(rejected[:, None], residual, p_n)
    P = positions + n
    key = torch.where(rejected, rng.hash_key(seeds, P, rng.STREAM_RESIDUAL), rng.hash_key(seeds, P, rng.STREAM_SAMPLE))
    token = exponential_race(dist, key)
    return _emit(x, accepted_len, token), accepted_len


def exponential_race(dist: torch.Tensor, key: torch.Tensor, chunk: int = 16384) -> torch.Tensor:
    """argmax_v dist[b, v] / Exp(key[b], v): a sample from dist [B, V] (first index on ties).

    Noise is made a vocabulary chunk at a time so the hash's int64 temporaries stay in cache
    (a loop over chunks, not requests); the running max keeps the earliest index on ties.
    """
    B, V = dist.shape
    best = torch.full((B,), -1.0, device=dist.device)
    token = torch.zeros(B, dtype=torch.int64, device=dist.device)
    for start in range(0, V, chunk):
        idx = torch.arange(start, min(V, start + chunk), device=dist.device)
        noise = -torch.log(rng.uniform_from_key(key[:, None], idx[None, :]))
        value, arg = (dist[:, start : start + chunk] / noise).max(-1)
        take = value > best
        best = torch.where(take, value, best)
        token = torch.where(take, arg + start, token)
    return token


def verify_rejection_triton(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p, seeds,
                            positions, has_filters=None, chunk: int | None = None):
    p = target_probs(target_logits, temperature, top_k, top_p, has_filters)
    return _tr.rejection_from_probs(p, draft_token_ids, draft_probs, seeds, positions, chunk)


def verify_rejection(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p, seeds, positions,
                     has_filters: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless rejection sampling of k drafts against the target; see the module docstring."""
    fn = verify_rejection_triton if use_triton(target_logits) else verify_rejection_ref
    return fn(target_logits, draft_token_ids, draft_probs, temperature, top_k, top_p, seeds, positions,
              has_filters)
