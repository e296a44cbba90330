"""EngineSettings: the engine's settings at the deployment boundary, each defined once.

The `tandem serve` flags (deploy/flags.py generates them from the fields), the Serve YAML's `args`, the
prefill and decode deployment configs (which extend this model with their own fields) and, last, the
engine's frozen `EngineConfig` are all made from these fields. A field that EngineConfig has under the
same name is passed on as is; the speculation fields become EngineConfig's `speculative`.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import EngineConfig

SpeculativeMethod = Literal["none", "mtp", "eagle3", "ngram", "draft_model", "grammar"]
DEFAULT_SPECULATIVE_TOKENS = 3  # k when a method is chosen without one


class EngineSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # a misspelt YAML key fails, it is not ignored

    model: str = Field(description="Target model directory (HF layout, with tokenizer and chat template).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where engines run; on CUDA one GPU per prefill "
                                                              "replica and per decode rank.")
    dtype: str | None = Field(None, description="Weights and KV dtype (float32 | bfloat16 | float16); default: "
                                                "the checkpoint's. Prefill and decode share it.")
    block_size: int = Field(16, ge=1, description="Tokens per KV block (prefill and decode share it).")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV blocks per engine; default: sized from memory.")
    kv_cache_memory_gb: float = Field(1.0, gt=0, description="CPU KV budget per engine when num_kv_blocks is "
                                                             "unset.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Share of GPU memory an engine may use "
                                                                        "(weights and KV) when num_kv_blocks "
                                                                        "is unset.")
    max_num_seqs: int = Field(64, ge=1, description="Most requests running at once per engine (prefill: prompts "
                                                    "in flight; decode: requests per group).")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Tokens per engine step (batched prompt chunks "
                                                                "and decodes).")
    max_model_len: int | None = Field(None, ge=1, description="Prompt + output token limit; default: the model's.")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of full blocks whose prefix another request "
                                                          "already computed (docs/engine.md); --no-prefix-caching "
                                                          "turns it off.")
    seed: int = Field(0, description="Base of the seeds of requests that bring none.")
    speculative_method: SpeculativeMethod = Field(
        "none", description="Speculative decoding method (one-model heads: mtp, eagle3; or ngram, draft_model; or "
                            "grammar: only the tokens a guided request's grammar forces, verified in one step).")
    draft: str | None = Field(None, description="Draft model or head directory for speculative decoding.")
    num_speculative_tokens: int = Field(0, ge=0, description=f"Draft tokens per step (k); 0 with a method means "
                                                             f"{DEFAULT_SPECULATIVE_TOKENS}.")
    speculative_topk: int = Field(1, ge=1, description="Draft trees (mtp, eagle3): each draft depth expands the "
                                                     "topk best children of the topk best nodes so far (EAGLE-2); "
                                                     "-k is the tree's depth. 1: the chain of k drafts.")
    num_verify_tokens: int | None = Field(None, ge=1, description="Draft trees: the nodes verified per request and "
                                                                  "step, k..topk*k; default k.")
    tree_score: Literal["calibrated", "draft"] = Field("calibrated", description="Draft trees: rank nodes by the "
                                                       "target's acceptance rate estimated online ('calibrated') or "
                                                       "by the head's probability ('draft', EAGLE-2's rule).")
    dynamic_k: str | None = Field(None, description="Dynamic speculation: comma-separated decode batch sizes at "
                                                    "which the drafts verified per request drop by one (e.g. "
                                                    "'16,32,64' with k=3); the decode group's batch decides, the "
                                                    "same k on every rank.")
    adaptive_k: bool = Field(False, description="Acceptance-driven k: each step the decode group verifies (and drafts) "
                                                "the k in 0..k that maximizes expected tokens per second, from measured "
                                                "acceptance at each draft depth and the measured cost of a draft "
                                                "position; under --dynamic-k, within its bound. Off: always k.")
    speculative_token_map: str | None = Field(
        None, description="mtp, eagle3: a file of the target token ids the head may draft (JSON list, or a torch file "
                          "of a 1-d tensor as SGLang's --speculative-token-map): its LM head multiplies those rows "
                          "only. Pays where the vocabulary is large (100k+); outputs are unchanged.")
    forced_drafts: bool = Field(True, description="With a speculative method: a guided request drafts the tokens "
                                                  "its grammar forces (keys, punctuation, enum values) ahead of the "
                                                  "method's own drafts; outputs are unchanged. Off only to measure it.")
    handover_transport: Literal["auto", "ipc", "network"] = Field(
        "auto", description="How KV payloads travel from prefill to decode: auto = CUDA IPC where both ends share "
                            "one GPU, NCCL between GPUs, gloo on CPU; ipc = also shared memory between processes "
                            "of one host on CPU; network = never shared memory. Either end's choice counts "
                            "(network wins); /metrics shows what was used (tandem_handovers_by_transport).")
    transfer_timeout_s: float = Field(60.0, gt=0, description="Deadline of one hand-over's answer and payload, on "
                                                              "the prefill's sending end and each decode rank's "
                                                              "receiving end.")
    fault_points: str = Field("", description="Testing only (tests, bench.soak --faults): fault points to arm, e.g. "
                                              "'handover.send_payload=stall:8' (cluster/faults.py); an armed point "
                                              "fires only for requests whose id names it. Empty: none.")
    torch_threads: int | None = Field(1, ge=1, description="torch threads per CPU engine (default of torch if "
                                                           "unset).")
    async_scheduling: bool = Field(False, description="Engines launch step N+1 before reading step N "
                                   "(engine/runner/overlap.py): hides host time on GPUs; on CPUs it only reorders it.")
    weight_dtype: Literal["bfloat16"] | None = Field(
        None, description="CPU engines: weight matrices rounded to bf16 at load and, with cpu_compile=full, read as bf16 "
                          "by the decode step's matmuls, the arithmetic staying in dtype (float32): half the weight "
                          "bytes per decode step (llama.cpp's bf16 model). Default: weights in dtype.")
    cpu_compile: Literal["off", "gemm", "layers", "full"] = Field(
        "off", description="CPU engines compile with inductor (engine/layers/cpu_compile.py): gemm = matmuls of 1-16 rows "
                           "through GEMMs on prepacked weights; layers = also each stretch between two attentions "
                           "compiled whole (tp 1, no ADP); full = the whole forward one graph, its attentions the C++ "
                           "CPU kernel's. Faster decode; a compile per shape at start-up.")

    @model_validator(mode="after")
    def _check(self):
        if not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model {self.model!r} is not a model directory (no config.json)")
        if self.speculative_token_map and self.speculative_method == "none":
            raise ValueError("speculative_token_map restricts a draft head's vocabulary: choose a speculative_method "
                             "(mtp, eagle3)")
        if self.speculative is not None:
            from engine import SpecConfig

            SpecConfig.coerce(self.speculative)  # the engine's own checks (k range, draft needed), early
        return self

    @property
    def speculative(self) -> dict | None:
        """EngineConfig's `speculative` (SpecConfig's fields); None without speculation."""
        if self.speculative_method == "none":
            return None
        spec = {"method": self.speculative_method, "k": self.num_speculative_tokens or DEFAULT_SPECULATIVE_TOKENS,
                "draft": self.draft}
        if not self.forced_drafts:
            spec["forced_drafts"] = False
        if self.speculative_token_map:
            spec["token_map"] = self.speculative_token_map
        if self.adaptive_k:
            spec["adaptive_k"] = True
        if self.speculative_topk != 1:
            spec["topk"] = self.speculative_topk
        if self.num_verify_tokens is not None:
            spec["num_verify_tokens"] = self.num_verify_tokens
        if self.tree_score != "calibrated":
            spec["tree_score"] = self.tree_score
        if self.dynamic_k:
            try:
                spec["dynamic_k"] = tuple(int(t) for t in self.dynamic_k.split(","))
            except ValueError:
                raise ValueError(f"dynamic_k must be comma-separated integers, got {self.dynamic_k!r}") from None
        return spec

    def engine_config(self, **overrides) -> EngineConfig:
        """The engine's config from these settings; `overrides` are EngineConfig fields set by the deployment
        (tp_size, tp_rank, ...)."""
        shared = {f.name for f in dataclasses.fields(EngineConfig)} & set(EngineSettings.model_fields)
        values = {name: getattr(self, name) for name in shared}
        return EngineConfig(**{**values, "speculative": self.speculative, **overrides})
