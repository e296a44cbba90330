"""TandemConfig: one deployment's settings (CLI flags, Serve YAML args), split into the per-role
configs of the router, prefill and decode deployments."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, model_validator

from decode_worker.config import DecodeConfig
from prefill_worker.config import PrefillConfig
from router.config import RouterConfig


class TandemConfig(BaseModel):
    model: str = Field(description="Target model directory (HF layout, with tokenizer and chat template).")
    served_model_name: str | None = Field(None, description="Name clients use in `model`; default: the "
                                                            "directory's name.")
    draft: str | None = Field(None, description="Draft model or head directory for speculative decoding.")
    speculative_method: Literal["none", "mtp", "eagle3", "ngram", "draft_model"] = Field(
        "none", description="Speculative decoding method (one-model heads: mtp, eagle3; or ngram, draft_model).")
    num_speculative_tokens: int = Field(0, ge=0, description="Draft tokens per step (k).")
    tp: int = Field(2, ge=1, description="Tensor-parallel ranks per decode group.")
    prefill_replicas: int = Field(1, ge=1, description="Prefill replicas (one engine each).")
    decode_replicas: int = Field(1, ge=1, description="Decode replicas (one group of `tp` ranks each).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where engines run; on CUDA one GPU per "
                                                              "prefill replica and per decode rank.")
    dtype: str | None = Field(None, description="Weights and KV dtype; default: the checkpoint's.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block (prefill and decode share it).")
    num_kv_blocks: int | None = Field(None, description="KV blocks per engine; default: sized from memory.")
    max_num_seqs: int = Field(64, ge=1, description="Most requests decoding at once per decode group.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Prompt tokens per prefill step.")
    max_model_len: int | None = Field(None, description="Prompt + output limit; default: the model's.")
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="CPU KV budget per engine when num_kv_blocks "
                                                             "is unset.")
    torch_threads: int | None = Field(1, description="torch threads per CPU engine.")
    max_inflight: int = Field(256, ge=1, description="Requests a router replica serves at once (then 429).")
    router_replicas: int = Field(1, ge=1, description="Router (HTTP ingress) replicas.")
    prefill_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs per prefill replica.")
    rank_num_cpus: float = Field(1.0, ge=0, description="Ray CPUs per decode rank.")

    @model_validator(mode="after")
    def _check(self) -> "TandemConfig":
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model {self.model!r} is not a model directory (no config.json)")
        if self.speculative_method != "none":
            from engine.spec.config import SpecConfig

            SpecConfig.coerce(self._speculative())  # the engine's own checks (k range, draft needed), early
        return self

    @property
    def name(self) -> str:
        return self.served_model_name or Path(self.model).resolve().name

    def _speculative(self) -> dict:
        if self.speculative_method == "none":
            return {}
        return {"method": self.speculative_method, "k": self.num_speculative_tokens or 3, "draft": self.draft}

    def prefill(self) -> PrefillConfig:
        return PrefillConfig(model=self.model, device=self.device, dtype=self.dtype, num_kv_blocks=self.num_kv_blocks,
                             block_size=self.block_size, max_num_seqs=self.max_num_seqs,
                             max_num_batched_tokens=self.max_num_batched_tokens, max_model_len=self.max_model_len,
                             kv_cache_memory_gb=self.kv_cache_memory_gb, torch_threads=self.torch_threads,
                             speculative=self._speculative() or None)

    def decode(self) -> DecodeConfig:
        return DecodeConfig(model=self.model, tp_size=self.tp, device=self.device, dtype=self.dtype,
                            num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
                            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
                            kv_cache_memory_gb=self.kv_cache_memory_gb, rank_num_cpus=self.rank_num_cpus,
                            torch_threads=self.torch_threads, speculative=self._speculative() or None)

    def router(self) -> RouterConfig:
        return RouterConfig(model=self.model, served_model_name=self.name, max_inflight=self.max_inflight)
