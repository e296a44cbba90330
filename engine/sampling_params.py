"""SamplingParams: what a user asks of one request. Validated once, at construction."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from structured.request import StructuredOutput


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    repetition_penalty: float = 1.0  # over prompt and output tokens (HF semantics)
    presence_penalty: float = 0.0  # over output tokens (OpenAI semantics)
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)  # stop strings on the detokenized text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's; n: plus the top n
    # vLLM's prompt_logprobs: each prompt token's logprob (plus the top n) in RequestOutput.prompt_logprobs,
    # computed once after the prompt ran (engine/prompt_logprobs.py); None: not computed
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit before anything else (grammar
    # masks, penalties, temperature; the draft's logits too); logprobs stay the raw model's
    logit_bias: dict[int, float] | None = None
    # vLLM's min_tokens: output tokens before EOS or a stop_token_ids token may end the output (stop strings
    # are not held back); 0 is off
    min_tokens: int = 0
    # constrain the output to a JSON Schema, any JSON object, a regex, an EBNF grammar or a choice
    # (a StructuredOutput, or a dict of its fields)
    structured_output: StructuredOutput | None = None
    # vLLM's cache_salt: requests share cached prefix blocks only with requests of the same salt (tenants that
    # must not learn, from timing, which prompts others sent); None: the shared default
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if isinstance(self.structured_output, dict):
            self.structured_output = StructuredOutput.from_dict(self.structured_output)
        _check(self.structured_output is None or isinstance(self.structured_output, StructuredOutput),
               "structured_output must be a StructuredOutput or a dict of its fields", "structured_output")
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0,
               f"max_tokens must be a positive integer, got {self.max_tokens!r}", "max_tokens")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}", "temperature")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}", "top_k")
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        _check(self.repetition_penalty > 0.0,
               f"repetition_penalty must be > 0, got {self.repetition_penalty}", "repetition_penalty")
        _check(-2.0 <= self.presence_penalty <= 2.0,
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}", "presence_penalty")
        _check(-2.0 <= self.frequency_penalty <= 2.0,
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}", "frequency_penalty")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings", "stop")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers", "stop_token_ids")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}", "min_tokens")
        _check(not (self.min_tokens and self.structured_output is not None),
               "min_tokens cannot be combined with a structured output: the grammar decides where the output ends",
               "min_tokens")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               f"logprobs must be between 0 and 20, got {self.logprobs!r}", "logprobs")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs!r}", "prompt_logprobs")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and 0 < len(self.cache_salt) <= 256),
               f"cache_salt must be a non-empty string of at most 256 characters, got {self.cache_salt!r}",
               "cache_salt")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
               f"seed must be an integer in [0, 2**63), got {self.seed!r}", "seed")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def _logit_bias(bias) -> dict[int, float]:
    """Token id -> bias, keys as ints (a JSON round trip, the hand-over's, makes them strings)."""
    _check(isinstance(bias, dict), "logit_bias must map token ids to biases", "logit_bias")
    out = {}
    for token, value in bias.items():
        try:
            token_id = int(token)
        except (TypeError, ValueError):
            token_id = -1
        _check(token_id >= 0 and str(token_id) == str(token), f"logit_bias keys are token ids, got {token!r}",
               "logit_bias")
        _check(isinstance(value, (int, float)) and not isinstance(value, bool) and -100.0 <= value <= 100.0,
               f"logit_bias values are numbers in [-100, 100], got {value!r} for token {token_id}", "logit_bias")
        out[token_id] = float(value)
    return out


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param=param)
