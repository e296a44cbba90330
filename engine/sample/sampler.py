"""Sampling from a batch of logits with per-request parameters, without host syncs.

Randomness is counter-based (kernels/rng.py): the token at sequence position P of a request with
seed S is sampled with noise that depends only on (S, P), never on the batch it shares; that is what
makes seeded sampling batch-invariant and lets speculation reproduce the same draws.
Order of processing: logit bias -> grammar mask -> penalties -> temperature -> top-k -> top-p -> min-p ->
exponential race. Logprobs are those of the raw model, before any of it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import numpy as np

import torch

from kernels import rng

if TYPE_CHECKING:
    from engine.core.request import Request


@dataclass(frozen=True, slots=True)
class SamplingBatch:
    temperature: torch.Tensor  # [N] f32, 0 = greedy
    top_k: torch.Tensor  # [N] int64, 0 = off
    top_p: torch.Tensor  # [N] f32, 1 = off
    min_p: torch.Tensor  # [N] f32, 0 = off
    seeds: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64 sequence position of the token being sampled
    # host-side facts about the batch, decided when it is built (no syncs at sampling time)
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    max_logprobs: int | None  # None: nobody asked; else the largest top-n requested
    # penalties (None when no request uses them)
    repetition: torch.Tensor | None = None  # [N] f32
    presence: torch.Tensor | None = None  # [N] f32
    frequency: torch.Tensor | None = None  # [N] f32
    output_counts: torch.Tensor | None = None  # [N, V] f32 counts of each id among output tokens
    seen_mask: torch.Tensor | None = None  # [N, V] bool: id occurs in prompt or output
    logit_bias: torch.Tensor | None = None  # [N, V] f32 added to the logits (None when no request has one)
    # min_tokens (None when no request is short of its min_tokens): the tokens a row may not sample yet, and
    # how many more output tokens it must write before they may end it
    early_stop_block: torch.Tensor | None = None  # [N, V] bool
    min_tokens_left: torch.Tensor | None = None  # [N] int64
    # [N] bool: the request gave its own seed, so its drafts are verified by coupling (engine/sample/verify.py):
    # its output is the plain sampler's whatever the drafting schedule. None: no row is coupled.
    coupled: torch.Tensor | None = None


    @property
    def mode(self) -> "SamplingMode":
        """The branches sampling this batch takes (what its CUDA graph is captured for)."""
        return SamplingMode(self.all_greedy, self.use_top_k, self.use_top_p, self.use_min_p, self.max_logprobs,
                            self.repetition is not None, self.logit_bias is not None,
                            self.early_stop_block is not None, self.coupled is not None)


@dataclass(frozen=True, slots=True)
class SamplingMode:
    """The host facts of a batch that pick sampling's branches, known from its requests alone: a CUDA graph
    is captured per mode (engine/runner/graphs.py), and an ADP group agrees on replay before any batch is
    built (engine/runner/model_runner.py)."""

    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    max_logprobs: int | None
    penalties: bool  # repetition / presence / frequency tensors
    logit_bias: bool
    min_tokens: bool  # some row may not end yet (early_stop_block)
    coupled: bool  # some sampled row has the user's seed

    @staticmethod
    def of(requests: list["Request"], vocab_size: int) -> "SamplingMode":
        """The mode build_sampling gives these requests (padding rows are greedy and change nothing)."""
        params = [r.params for r in requests]
        sampling_rows = [p for p in params if not p.greedy]
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMode(
            all_greedy=not sampling_rows,
            use_top_k=any(0 < p.top_k < vocab_size for p in sampling_rows),
            use_top_p=any(p.top_p < 1.0 for p in sampling_rows),
            use_min_p=any(p.min_p > 0.0 for p in sampling_rows),
            max_logprobs=max(asked) if asked else None,
            penalties=any(p.uses_penalties for p in params),
            logit_bias=any(p.logit_bias for p in params),
            min_tokens=any(r.params.min_tokens > r.num_output_tokens and r.min_tokens_block for r in requests),
            coupled=_any_coupled(params))


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    logprobs: torch.Tensor | None  # [N] f32 logprob of the sampled token under the raw model distribution
    top_ids: torch.Tensor | None  # [N, n] int64
    top_logprobs: torch.Tensor | None  # [N, n] f32


def apply_logit_bias(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """logits [N, V] + bias [N, V] (OpenAI's logit_bias), first of all processing: a new tensor, which a
    grammar mask may then fill in place."""
    return logits if bias is None else logits + bias


def block_early_stops(logits: torch.Tensor, b: SamplingBatch, offsets: torch.Tensor | None = None) -> torch.Tensor:
    """logits [N, V] with -inf on the tokens that would end an output shorter than its min_tokens (EOS, stop
    ids); offsets [N]: how far past the row's first sampled position each row is (verification's chains)."""
    if b.early_stop_block is None:
        return logits
    early = b.min_tokens_left > (0 if offsets is None else offsets)  # [N]
    return logits.masked_fill(b.early_stop_block & early[:, None], float("-inf"))


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    if b.repetition is None:
        return logits
    rep = b.repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(b.seen_mask, penalized, logits)
    logits = logits - b.frequency[:, None] * b.output_counts
    return logits - b.presence[:, None] * (b.output_counts > 0).to(logits.dtype)


def processed_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p applied; masked entries are -inf. Rows with temperature 0
    are scaled by 1 (their token is the argmax anyway)."""
    temp = torch.where(b.temperature > 0, b.temperature, torch.ones_like(b.temperature))
    logits = logits / temp[:, None]
    if b.use_top_k or b.use_top_p:
        logits = _top_k_top_p(logits, b)
    if b.use_min_p:
        probs = logits.softmax(dim=-1)
        threshold = b.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    rank = torch.arange(vocab, device=logits.device)[None, :]
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if b.use_top_k:
        k = torch.where(b.top_k > 0, b.top_k, torch.full_like(b.top_k, vocab))
        remove |= rank >= k[:, None]
    if b.use_top_p:
        probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p; the first token always stays.
        remove |= (mass_before >= b.top_p[:, None]) & (rank > 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def race(probs: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """probs [N, V] -> [N] int64: the exponential race argmax(probs / E) on the STREAM_SAMPLE numbers of
    (seed, position), the draw of the token at that position. The one definition of it: the sampler, the
    verification of drafts and the drafters' coupled drafts all draw through it, so they agree bit for bit."""
    return (probs / rng.exponential(seeds, positions, probs.shape[-1], rng.STREAM_SAMPLE)).argmax(dim=-1)


def sample(logits: torch.Tensor, b: SamplingBatch, mask: Callable[[torch.Tensor], None] | None = None) -> SamplerOutput:
    """logits [N, V] fp32 -> one token per row. mask: constrains the logits in place (a LogitsMasker's);
    logprobs stay those of the raw model."""
    raw_logprobs = logits.log_softmax(dim=-1) if b.max_logprobs is not None else None
    logits = block_early_stops(apply_logit_bias(logits, b.logit_bias), b)
    if mask is not None:
        mask(logits)
    logits = apply_penalties(logits, b)
    greedy = logits.argmax(dim=-1)
    if b.all_greedy:
        tokens = greedy
    else:
        sampled = race(processed_logits(logits, b).softmax(dim=-1), b.seeds, b.positions)
        tokens = torch.where(b.temperature > 0, sampled, greedy)
    if raw_logprobs is None:
        return SamplerOutput(tokens, None, None, None)
    token_lp = raw_logprobs.gather(-1, tokens[:, None]).squeeze(-1)
    top_lp, top_ids = (raw_logprobs.topk(b.max_logprobs, dim=-1) if b.max_logprobs > 0 else (None, None))
    return SamplerOutput(tokens, token_lp, top_ids, top_lp)


# ------------------------------------------------------------------ building a batch
def sampling_columns(requests: list["Request"], positions: np.ndarray, size: int) -> dict[str, np.ndarray]:
    """The per-row columns of a SamplingBatch as host arrays (padded with idle rows up to `size`), for the
    caller to send to the device with the step's other inputs in one copy (engine/runner/staging.py)."""
    params = [r.params for r in requests]
    pad = size - len(requests)

    def column(values: list, fill, dtype) -> np.ndarray:
        return np.array(values + [fill] * pad, dtype=dtype)

    columns = dict(temperature=column([p.temperature for p in params], 0.0, np.float32),
                   top_k=column([p.top_k for p in params], 0, np.int64),
                   top_p=column([p.top_p for p in params], 1.0, np.float32),
                   min_p=column([p.min_p for p in params], 0.0, np.float32),
                   seeds=column([r.seed for r in requests], 0, np.int64),
                   positions=np.asarray(positions, dtype=np.int64))
    if _any_coupled(params):
        columns["coupled"] = column([p.seed is not None for p in params], False, np.bool_)
    return columns


def build_sampling(requests: list["Request"], positions: np.ndarray, size: int, device: torch.device,
                   vocab_size: int, columns: dict[str, torch.Tensor] | None = None) -> SamplingBatch:
    """The requests' sampling parameters, padded with idle (greedy, penalty-free) rows up to `size`.
    positions [size] int64: the sequence position of each row's first sampled token. columns: the
    `sampling_columns` of the same arguments, already on the device (else they are copied here)."""
    if columns is None:
        columns = {name: torch.from_numpy(a).to(device, non_blocking=True)
                   for name, a in sampling_columns(requests, positions, size).items()}
    mode = SamplingMode.of(requests, vocab_size)
    penalties = {}
    if mode.penalties:
        penalties = _penalty_tensors(requests, size, vocab_size, device)
    if mode.logit_bias:
        penalties["logit_bias"] = _bias_tensor([r.params for r in requests], size, vocab_size, device)
    if mode.min_tokens:
        penalties.update(_min_tokens_tensors(requests, size, vocab_size, device))
    return SamplingBatch(
        temperature=columns["temperature"], top_k=columns["top_k"], top_p=columns["top_p"], min_p=columns["min_p"],
        seeds=columns["seeds"], coupled=columns.get("coupled"), positions=columns["positions"],
        all_greedy=mode.all_greedy, use_top_k=mode.use_top_k, use_top_p=mode.use_top_p, use_min_p=mode.use_min_p,
        max_logprobs=mode.max_logprobs, **penalties,
    )


def _any_coupled(params: list) -> bool:
    """A batch with no sampled seeded row skips the coupled draw (greedy rows are checked against the argmax
    either way; engine/sample/verify.py), and keeps the graph mode of one."""
    return any(p.seed is not None and not p.greedy for p in params)


def _min_tokens_tensors(requests: list["Request"], size: int, vocab_size: int, device: torch.device) -> dict:
    block = torch.zeros(size, vocab_size, dtype=torch.bool)
    left = torch.zeros(size, dtype=torch.int64)
    for i, r in enumerate(requests):
        if r.min_tokens_block:
            block[i, torch.tensor(r.min_tokens_block, dtype=torch.int64)] = True
            left[i] = max(0, r.params.min_tokens - r.num_output_tokens)
    return {"early_stop_block": block.to(device, non_blocking=True),
            "min_tokens_left": left.to(device, non_blocking=True)}


def _bias_tensor(params: list, size: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[size, V] f32: each request's logit_bias (token id -> bias) as a dense row; idle rows are 0."""
    bias = torch.zeros(size, vocab_size, dtype=torch.float32)
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.int64)
            bias[i, ids] = torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
    return bias.to(device, non_blocking=True)


def _penalty_tensors(requests: list["Request"], size: int, vocab_size: int, device: torch.device) -> dict:
    counts = torch.zeros(size, vocab_size, dtype=torch.float32)
    seen = torch.zeros(size, vocab_size, dtype=torch.bool)
    for i, r in enumerate(requests):
        out = torch.tensor(r.output_token_ids, dtype=torch.int64)
        if out.numel():
            counts[i].scatter_add_(0, out, torch.ones(out.numel()))
        seen[i, torch.tensor(r.token_ids, dtype=torch.int64)] = True
    pad = size - len(requests)

    def column(values: list, fill: float) -> torch.Tensor:
        return torch.tensor(values + [fill] * pad, dtype=torch.float32)

    fields = {
        "repetition": column([r.params.repetition_penalty for r in requests], 1.0),
        "presence": column([r.params.presence_penalty for r in requests], 0.0),
        "frequency": column([r.params.frequency_penalty for r in requests], 0.0),
        "output_counts": counts,
        "seen_mask": seen,
    }
    return {k: v.to(device) for k, v in fields.items()}
