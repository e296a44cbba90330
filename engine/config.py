"""Configs: EngineConfig (what the user chose), ModelConfig (what the checkpoint says) and SpecConfig
(which speculative method the engine runs, with how many draft tokens per step)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config_mla import (MLAConfig, MoEConfig, deepseek_moe_from_hf, mla_from_hf, mla_rope_params, rope_params,
                               qwen3_moe_from_hf)
from engine.errors import ModelLoadError, UnsupportedModelError

# The Llama family shares one module (engine/models/llama.py; these flags are what differs); DeepSeek-V3
# has its own (engine/models/deepseek_v3.py). engine/models/registry.py maps a family to its model.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",  # Qwen3 attention, MoE MLPs (engine/models/qwen3_moe.py)
    "DeepseekV3ForCausalLM": "deepseek_v3",
}
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


METHODS = ("mtp", "eagle3", "ngram", "draft_model", "grammar")
MAX_K = 8
MAX_TOPK = 8
MAX_TREE_NODES = 63  # a tree's nodes and its root fit one 64-bit attention mask (kernels/tree_mask.py)


def chain_margin(k: int) -> int:
    """Positions a draft chain reaches past the KV lengths of the rows it starts from: k draft steps
    after the verified token."""
    return k + 2


def position_margin(k: int) -> int:
    """Positions past max_model_len that a step with k drafts may touch (the rope table and graph
    block tables cover them): padded verification rows (k+1) plus a chain after a full acceptance."""
    return 2 * k + 2 if k else 0


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """`LLM(model, speculative=SpecConfig(method="eagle3", k=3, draft="path/to/head"))`.

    - mtp: a DeepSeek-V3 MTP layer (`model.layers.{N}.*`, N = the target's num_hidden_layers), reused
      for all k steps. `draft` is its directory; None reads it from the target's own checkpoint.
    - eagle3: an EAGLE-3 head in its authors' layout (`LlamaForCausalLMEagle3`); `draft` required.
    - ngram: prompt lookup over the prompt and the generated tokens; no model.
    - draft_model: a separate small causal LM with the target's tokenizer; `draft` required.
    - grammar: no draft network and no lookup: a guided request drafts only the tokens its grammar
      forces (`forced_drafts`), so they are verified in one step; unguided requests run plain steps
      (with k+1 verification rows of room).
    """

    method: str
    k: int = 3
    draft: str | None = None
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram tried first
    prompt_lookup_min: int = 1  # ngram: shortest suffix n-gram tried last
    # Mask the draft network's own steps with the request's grammar (or other LogitsMasker), so its
    # drafts are valid and acceptance rises; off only to measure what it gains.
    draft_masks: bool = True
    # Draft the tokens a guided request's grammar forces (structured/forced.py: its jump-forward string,
    # retokenized canonically, and single admissible tokens) ahead of the method's own drafts: through
    # the draft masks for a draft network (which then drafts on after them), in front of prompt lookup's
    # drafts on the host. Off only to measure what it gains.
    forced_drafts: bool = True
    # Dynamic k: the batch sizes at which the drafts verified per request drop by one (e.g. (16, 32, 64)
    # with k=3: 3 drafts below 16 requests, 2 from 16, 1 from 32, none from 64), because past some
    # batch the verification rows cost more than the accepted drafts save. The batch is the whole
    # decode group's (under attention data parallelism every rank decides the same k from the group's
    # last agreement). Empty: always k.
    dynamic_k: tuple[int, ...] = ()
    # Acceptance-driven k (engine/speculative/adaptive.py): each step verifies, and drafts for the next, the k
    # in [0, k] (under dynamic_k's bound) that maximizes expected tokens per second, from running estimates of
    # acceptance at each draft depth (per request and grammar class) and of a draft position's cost; one k for
    # the group (ADP ranks agree on it in the step's all-gather). Off: always k (to measure it).
    adaptive_k: bool = False
    # Adaptive k's start-up cost probe (engine/runner/cost_probe.py): steps of idle requests timed at each batch size
    # and k before the first request, the cost table's prior. Off: the prior is a line 1 + 0.2 k (to measure it).
    cost_probe: bool = True
    # mtp, eagle3 chains with adaptive_k, without ADP: a step that drafts nothing (k = 0) skips the head's pass
    # over its decoding rows, which a later drafting step catches up from their stored inputs
    # (engine/speculative/deferred_kv.py). Off: every step runs it (to measure it).
    defer_draft_kv: bool = True
    # mtp, eagle3: a file of the target token ids the head may draft (engine/speculative/token_map.py):
    # its LM head multiplies those rows only. None: the head's whole vocabulary.
    token_map: str | None = None
    # Draft trees (EAGLE-2; mtp, eagle3; engine/speculative/tree.py): k is the tree's depth; each depth expands
    # the `topk` children of the `topk` best nodes so far by cumulative draft probability, and the
    # `num_verify_tokens` best nodes are verified in one forward. topk=1 is the chain of k drafts.
    topk: int = 1
    num_verify_tokens: int | None = None  # draft nodes verified per request; None: k (the chain's)
    # How a tree ranks its nodes: "calibrated" by the target's acceptance rate estimated online from the head's
    # probability (engine/speculative/tree_score.py), "draft" by the head's probability (EAGLE-2; to measure it).
    tree_score: str = "calibrated"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown speculative method {self.method!r}; use one of {METHODS}")
        if not isinstance(self.k, int) or not 1 <= self.k <= MAX_K:
            raise ValueError(f"speculative k must be an integer in [1, {MAX_K}], got {self.k!r}")
        if self.method in ("eagle3", "draft_model") and not self.draft:
            raise ValueError(f"speculative method {self.method!r} needs `draft`: the draft checkpoint directory")
        object.__setattr__(self, "dynamic_k", tuple(self.dynamic_k))
        if any(not isinstance(t, int) or t < 1 for t in self.dynamic_k) or list(self.dynamic_k) != sorted(
                set(self.dynamic_k)) or len(self.dynamic_k) > self.k:
            raise ValueError(f"dynamic_k must be at most k={self.k} increasing batch sizes >= 1, got {self.dynamic_k!r}")
        if self.token_map is not None and self.method not in ("mtp", "eagle3"):
            raise ValueError(f"a speculative token map restricts a draft head's vocabulary (mtp, eagle3), "
                             f"not {self.method!r}")
        self._check_tree()
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")

    def _check_tree(self) -> None:
        if not isinstance(self.topk, int) or not 1 <= self.topk <= MAX_TOPK:
            raise ValueError(f"speculative topk must be an integer in [1, {MAX_TOPK}], got {self.topk!r}")
        if self.tree_score not in ("calibrated", "draft"):
            raise ValueError(f"speculative tree_score must be 'calibrated' or 'draft', got {self.tree_score!r}")
        if self.topk > 1 and self.method not in ("mtp", "eagle3"):
            raise ValueError(f"speculative topk > 1 (draft trees) is built for the heads mtp and eagle3, "
                             f"not {self.method!r}")
        if self.topk > 1 and (self.adaptive_k or self.dynamic_k):
            raise ValueError("speculative topk > 1 (draft trees) has a fixed depth: adaptive_k and dynamic_k "
                             "are not built for trees")
        n = self.num_verify_tokens
        if n is None:
            return
        top = min(self.topk * self.k, MAX_TREE_NODES)
        if not isinstance(n, int) or not self.k <= n <= top:
            raise ValueError(f"num_verify_tokens (draft nodes verified per request) must be an integer in "
                             f"[k, min(topk * k, {MAX_TREE_NODES})] = [{self.k}, {top}] for k={self.k}, "
                             f"topk={self.topk}; got {n!r}")

    @property
    def tree(self) -> bool:
        """Drafts form a tree (topk > 1) rather than a chain."""
        return self.topk > 1

    @property
    def num_nodes(self) -> int:
        """Drafts verified per request and step: the tree's nodes, or the chain's k."""
        return self.num_verify_tokens if self.num_verify_tokens is not None else self.k

    def k_for(self, batch: int) -> int:
        """Drafts to verify per request this step, for a decode batch of `batch` requests."""
        return max(0, self.k - sum(batch >= t for t in self.dynamic_k))

    @property
    def uses_model(self) -> bool:
        """A draft network runs inside the step (everything but ngram and grammar)."""
        return self.method not in ("ngram", "grammar")

    @property
    def lookahead_slots(self) -> int:
        """KV slots past the verified chain that the draft chain writes (a full acceptance moves the
        chain's start k positions further). A tree's expansion writes `topk` nodes at each of its k - 1
        inner depths."""
        if not self.uses_model:
            return 0
        return max(self.k, (self.k - 1) * self.topk) if self.tree else self.k

    @staticmethod
    def coerce(value: "SpecConfig | dict | None") -> "SpecConfig | None":
        if value is None or isinstance(value, SpecConfig):
            return value
        if isinstance(value, dict):
            return SpecConfig(**value)
        raise TypeError(f"speculative must be a SpecConfig or a dict, got {type(value).__name__}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE; else HF's rope parameters (rope_type, factor, ...)
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    checkpoint_dtype: torch.dtype
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_window: int | None
    # DeepSeek-V3 family (engine/config_mla.py); None for dense Llama-family models. With MLA, num_kv_heads
    # is 1 and head_dim the latent cache's row (kv_lora_rank + qk_rope_head_dim): what one token caches.
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None

    @staticmethod
    def from_dir(model_dir: str | os.PathLike) -> "ModelConfig":
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is not a model directory: config.json is missing")
        try:
            raw = json.loads((path / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path / 'config.json'} is not valid JSON: {e}") from e
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported architecture {archs or raw.get('model_type')!r} in {path}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(path)
        return ModelConfig.from_hf(hf, arch)

    @staticmethod
    def from_hf(hf, arch: str) -> "ModelConfig":
        family = SUPPORTED_ARCHITECTURES[arch]
        if family == "deepseek_v3":
            return _deepseek_v3(hf, arch)
        if family == "qwen3_moe":
            _refuse_quantized(hf)
        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        theta, scaling = rope_params(hf, SUPPORTED_ROPE_TYPES)
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
        if isinstance(dtype, str):
            dtype = _DTYPES.get(dtype, torch.float32)
        attention_bias = bool(getattr(hf, "attention_bias", False))
        sliding = getattr(hf, "sliding_window", None)
        if family in ("qwen2", "qwen3_moe") and not getattr(hf, "use_sliding_window", False):
            sliding = None
        return ModelConfig(
            architecture=arch,
            family=family,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family in ("qwen2", "qwen3", "qwen3_moe") else attention_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            hidden_act=getattr(hf, "hidden_act", "silu"),
            checkpoint_dtype=dtype,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            sliding_window=sliding,
            moe=qwen3_moe_from_hf(hf) if family == "qwen3_moe" else None,
        )


def _eos_ids(hf) -> tuple[int, ...]:
    eos = hf.eos_token_id
    return tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))


def _refuse_quantized(hf) -> None:
    """The published DeepSeek-V3/R1 (and Qwen3-MoE FP8) weights are FP8 blocks with scales: cast as they are,
    they would be garbage."""
    quant = getattr(hf, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else type(quant).__name__
        raise UnsupportedModelError(f"quantized checkpoints ({method}) are not supported; convert the weights to "
                                    f"bf16 first (DeepSeek's fp8_cast_bf16.py does)")


def _deepseek_v3(hf, arch: str) -> ModelConfig:
    _refuse_quantized(hf)
    mla = mla_from_hf(hf)
    theta, scaling = mla_rope_params(hf)
    dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, torch.float32)
    return ModelConfig(
        architecture=arch, family="deepseek_v3", vocab_size=hf.vocab_size, hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size, num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
        num_kv_heads=1, head_dim=mla.cache_width, rms_norm_eps=hf.rms_norm_eps,
        max_position_embeddings=hf.max_position_embeddings, rope_theta=theta, rope_scaling=scaling,
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), qkv_bias=False,
        o_bias=mla.attention_bias, mlp_bias=False, qk_norm=False, hidden_act=getattr(hf, "hidden_act", "silu"),
        checkpoint_dtype=dtype, bos_token_id=getattr(hf, "bos_token_id", None), eos_token_ids=_eos_ids(hf),
        sliding_window=None, mla=mla, moe=deepseek_moe_from_hf(hf))


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str | torch.dtype | None = None  # None: the checkpoint's dtype (fp16 becomes fp32 on CPU)
    max_num_seqs: int = 64  # cap on running requests
    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decodes)
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb / free GPU memory
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    # Reuse the KV of full blocks whose tokens (and model and cache salt) another request already computed
    # (engine/core/prefix_cache.py); outputs are the same with it off
    enable_prefix_caching: bool = True
    kv_cache_memory_gb: float = 1.0  # CPU budget when num_kv_blocks is None
    gpu_memory_utilization: float = 0.85
    seed: int = 0  # base of the seeds given to requests without one
    tp_size: int = 1
    tp_rank: int = 0
    # Attention data parallelism over the tp_size ranks (engine/distributed/data_parallel.py): 1 = off (attention heads
    # sharded), tp_size = each rank runs attention for its own requests with whole-head KV, the MLP stays
    # sharded over the group. Attention TP inside DP groups (1 < attention_dp < tp_size) is not built yet.
    attention_dp: int = 1
    adp_exchange: str = "reduce_scatter"  # how MLP rows come back: reduce_scatter | all_reduce
    # MoE models: the routed experts sharded whole across the tp_size ranks (each holds num_experts / tp_size of
    # them) instead of every expert's intermediate dim; with attention_dp, the SGLang / TensorRT-LLM DeepSeek layout
    # (DP attention + EP MoE). No effect on dense layers or a single rank.
    expert_parallel: bool = False
    speculative: SpecConfig | None = None  # speculative decoding (a dict of SpecConfig's fields works too); None = off
    cuda_graphs: bool = True  # on CUDA, capture the decode step per padded batch size
    max_graph_batch: int | None = None  # None: max_num_seqs
    # Guided decode steps replay graphs too, their grammar fills running as captured host functions
    # (engine/masking/graph.py); False: such steps run eagerly.
    graph_masks: bool = True
    detokenize: bool = True  # keep each request's text and apply stop strings (off where the router does both)
    # Plan and launch step N+1 before reading step N's outputs (engine/runner/overlap.py): hides the host's work
    # behind the device's on a GPU; on a CPU it only reorders it. Steps with grammars, penalties, prompt
    # lookup, ADP or prefill-only requests run synchronously all the same.
    async_scheduling: bool = False
    # CPU only (engine/layers/cpu_compile.py): "gemm" runs matmuls of 1-16 rows (decode, verification chains, draft
    # passes) through inductor-compiled GEMMs on prepacked weights (engine/layers/packed_gemm.py); "layers" also
    # compiles each stretch between two attentions of the target (and an MTP head or draft model) into one
    # kernel set per row bucket (engine/models/piecewise.py), with tp_size 1 and no ADP (else as "gemm"); "full"
    # compiles the whole forward of a row bucket as one graph, its attentions inside as the C++ CPU kernel's ops
    # (as "layers" where that kernel does not serve the model's head dim or is off).
    # Costs a compile per shape at start-up and a packed copy of the weights per row bucket used.
    cpu_compile: str = "off"  # off | gemm | layers | full
    # CPU only (engine/layers/weight_dtype.py): "bfloat16" rounds every weight matrix to bf16 at load and, under
    # cpu_compile="full", streams the decode step's matmuls from a bf16 copy, widened to fp32 in registers:
    # activations, KV and logits stay in `dtype` (float32). Half the weight bytes per decode step; llama.cpp's
    # bf16 model. None: weights in `dtype`.
    weight_dtype: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpecConfig.coerce(self.speculative))
        if str(self.model).lower().endswith(".gguf"):  # read through its converted directory
            from engine.models.gguf import gguf_model_dir  # here, not at the top: config sits below models

            object.__setattr__(self, "model", str(gguf_model_dir(self.model)))
        if self.cpu_compile not in ("off", "gemm", "layers", "full"):
            raise ValueError(f"cpu_compile must be 'off', 'gemm', 'layers' or 'full', got {self.cpu_compile!r}")
        if self.weight_dtype is not None:
            if _DTYPES.get(self.weight_dtype) != torch.bfloat16:
                raise ValueError(f"weight_dtype must be None or 'bfloat16' (bf16), got {self.weight_dtype!r}")
            if self.device != "cpu":
                raise ValueError(f"weight_dtype is a CPU option (bf16 weights, fp32 arithmetic); on {self.device!r} "
                                 f"pass dtype={self.weight_dtype!r} instead")
        if self.attention_dp not in (1, self.tp_size):
            raise ValueError(f"attention_dp must be 1 (off) or tp_size ({self.tp_size}), got {self.attention_dp}: "
                             f"attention tensor parallelism inside data-parallel groups is not supported")

    def torch_weight_dtype(self) -> torch.dtype | None:
        """weight_dtype as a torch dtype; None: weights in the engine's dtype."""
        return None if self.weight_dtype is None else _DTYPES[self.weight_dtype]

    def torch_dtype(self, model_cfg: ModelConfig) -> torch.dtype:
        if self.dtype is None:
            dt = model_cfg.checkpoint_dtype
            if self.device == "cpu" and dt == torch.float16:
                return torch.float32  # fp16 matmuls on CPU are slow and lossy
            return dt
        if isinstance(self.dtype, torch.dtype):
            return self.dtype
        if self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; use one of {sorted(_DTYPES)}")
        return _DTYPES[self.dtype]
