"""RequestIntake: turns what a caller submits (a prompt as text or token ids, sampling parameters) into a
validated Request, or refuses it with an InvalidRequestError naming the bad field, before anything of it
reaches the running batch. It owns the model's tokenizer, its end tokens and the seeds drawn for
requests that bring none.
"""
from __future__ import annotations

import random
from pathlib import Path

from engine.core.request import Continuation, Request
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import InvalidRequestError
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams


class RequestIntake:
    def __init__(self, model_dir: str, vocab_size: int, eos_token_ids, max_model_len: int, detokenize: bool,
                 seed: int | None, in_use: dict[str, Request]):
        """eos_token_ids: the model config's (the tokenizer's own is added); in_use: the engine's requests by
        id, whose ids a new request may not reuse."""
        self.tokenizer = load_tokenizer(model_dir)
        self.vocab_size = vocab_size
        eos = set(eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.max_model_len = max_model_len
        self._detokenize = detokenize and self.tokenizer is not None
        self._seeds = random.Random(seed)
        self._in_use = in_use

    def new(self, request_id: str, prompt, params: SamplingParams, prefill_only: bool,
            seed: int | None = None, continuation: Continuation | None = None) -> Request:
        """seed: a hand-over's (the prefill side drew it); default the params' or a fresh one.
        continuation: the output the request had produced elsewhere (it resumes after it, with its seed)."""
        if request_id in self._in_use:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        ids = self.tokenize(prompt)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens; this model accepts at most {self.max_model_len - 1} "
                f"(max_model_len {self.max_model_len} includes at least one output token)", param="prompt")
        if seed is None:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        detokenizer = None
        if self._detokenize:
            detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                                                 params.skip_special_tokens)
        block = ()
        if params.min_tokens:
            block = tuple(sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)))
        if continuation is not None:
            seed = continuation.seed
        req = Request(request_id, ids, params, seed=seed, max_total_tokens=self.max_model_len,
                      prefill_only=prefill_only, detokenizer=detokenizer, min_tokens_block=block)
        if continuation is not None and continuation.output_token_ids:
            self._continue(req, continuation)
        return req

    def _continue(self, req: Request, c: Continuation) -> None:
        """Give `req` the output it had produced elsewhere: reported already, so only what follows is new."""
        out = list(c.output_token_ids)
        bad = [t for t in out if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequestError(f"continuation token id(s) {bad[:5]} outside the vocabulary [0, "
                                      f"{self.vocab_size})", param="continuation")
        if len(out) >= req.params.max_tokens or req.num_prompt_tokens + len(out) >= self.max_model_len:
            raise InvalidRequestError(f"a continuation of {len(out)} output tokens leaves no token to generate "
                                      f"(max_tokens {req.params.max_tokens}, max_model_len {self.max_model_len})",
                                      param="continuation")
        if req.params.logprobs is not None:
            if len(c.logprobs) != len(out):
                raise InvalidRequestError(f"a continuation of a request with logprobs carries one per output token "
                                          f"({len(out)}), got {len(c.logprobs)}", param="continuation")
            req.logprobs = [TokenLogprob(int(t), float(lp), top) for t, lp, top in c.logprobs]
        req.token_ids.extend(out)
        req.num_reported = len(out)
        req.metrics.num_output_tokens = len(out)
        if req.detokenizer is not None:
            req.detokenizer.push(out)

    def tokenize(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model directory has no tokenizer; pass token ids", param="prompt")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id(s) {bad[:5]} outside the vocabulary [0, "
                                          f"{self.vocab_size})", param="prompt")
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        return ids


def load_tokenizer(model_dir: str):
    """The model directory's tokenizer, or None when it ships none (then prompts are token ids)."""
    path = Path(model_dir)
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
