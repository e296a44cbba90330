"""DecodeConfig: what a decode deployment is told at the deployment boundary (pydantic)."""
from __future__ import annotations

from pydantic import BaseModel, Field


class DecodeConfig(BaseModel):
    model: str = Field(description="Model directory (HF layout) every rank loads its shard from.")
    tp_size: int = Field(2, ge=1, description="Tensor-parallel ranks per decode group (one group per replica).")
    device: str = Field("cpu", description="'cpu' or 'cuda'; one GPU per rank on CUDA.")
    dtype: str | None = Field(None, description="Weights and KV dtype; None keeps the checkpoint's.")
    num_kv_blocks: int | None = Field(None, description="KV blocks per rank; None sizes them from memory.")
    block_size: int = Field(16, description="Tokens per KV block; must equal the prefill's.")
    max_num_seqs: int = Field(64, description="Most requests decoding at once per group.")
    max_model_len: int | None = Field(None, description="Prompt + output token limit; None: the model's.")
    kv_cache_memory_gb: float = Field(1.0, description="CPU KV budget per rank when num_kv_blocks is None.")
    rank_num_cpus: float = Field(1.0, description="Ray CPUs reserved per rank.")
    torch_threads: int | None = Field(1, description="torch threads per rank on CPU (None: torch's default).")
    handover_timeout_s: float = Field(60.0, description="How long a stream waits for its hand-over header.")
    step_timeout_s: float = Field(120.0, description="A step slower than this is treated as a dead group.")
    seed: int = Field(0, description="Base of the seeds of requests that bring none.")
    speculative: dict | None = Field(None, description="engine SpecConfig fields (method, k, draft); None: off. "
                                                       "Prefill and decode must agree (the draft's KV is handed over).")

    def engine_config(self) -> dict:
        return dict(model=self.model, device=self.device, dtype=self.dtype, num_kv_blocks=self.num_kv_blocks,
                    block_size=self.block_size, max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                    kv_cache_memory_gb=self.kv_cache_memory_gb, seed=self.seed,
                    speculative=self.speculative)
