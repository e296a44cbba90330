"""PrefillConfig and the request/result records of the prefill deployment's boundary."""
from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, Field


class PrefillConfig(BaseModel):
    model: str = Field(description="Model directory (HF layout) of the target model.")
    device: str = Field("cpu", description="'cpu' or 'cuda' (one GPU per replica).")
    dtype: str | None = Field(None, description="Weights and KV dtype; must match the decode group's.")
    num_kv_blocks: int | None = Field(None, description="KV blocks; None sizes them from memory.")
    block_size: int = Field(16, description="Tokens per KV block; must equal the decode group's.")
    max_num_seqs: int = Field(64, description="Most prompts in flight at once.")
    max_num_batched_tokens: int = Field(2048, description="Prompt tokens per prefill step (batched prompts).")
    max_model_len: int | None = Field(None, description="Prompt + output token limit; None: the model's.")
    kv_cache_memory_gb: float = Field(1.0, description="CPU KV budget when num_kv_blocks is None.")
    torch_threads: int | None = Field(1, description="torch threads on CPU (None: torch's default).")
    transfer_timeout_s: float = Field(60.0, description="Deadline of one hand-over's answer and payload.")
    connect_timeout_s: float = Field(30.0, description="Deadline for opening a channel to a decode rank.")
    seed: int = Field(0, description="Base of the seeds of requests that bring none.")
    speculative: dict | None = Field(None, description="engine SpecConfig fields (method, k, draft); None: off. "
                                                       "Prefill and decode must agree (the draft's KV is handed over).")

    def engine_config(self) -> dict:
        return dict(model=self.model, device=self.device, dtype=self.dtype, num_kv_blocks=self.num_kv_blocks,
                    block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                    kv_cache_memory_gb=self.kv_cache_memory_gb, seed=self.seed,
                    speculative=self.speculative)


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: dict  # engine.SamplingParams fields, already validated by the router


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    token_ids: list[int]  # output tokens sampled by the prefill (the first one)
    finished: bool  # True: nothing to hand over (stopped at the first token, or aborted)
    finish_reason: str | None
    logprobs: list = field(default_factory=list)  # (token id, logprob, top) per token, when asked
    queue_seconds: float = 0.0  # submitted -> first scheduled
    prefill_seconds: float = 0.0  # first scheduled -> first token


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the router needs to validate and tokenize requests."""
    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
