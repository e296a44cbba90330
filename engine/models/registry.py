"""Which model class serves a checkpoint: the architecture's family (ModelConfig.family) decides. The model
runner builds the target through here and allocates its KV cache from the model's own `kv_cache_spec()`."""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.data_parallel import DPContext
from engine.distributed.parallel import TPContext
from engine.errors import UnsupportedModelError

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.family in LLAMA_FAMILY:
        from engine.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    if cfg.family == "qwen3_moe":
        from engine.models.qwen3_moe import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM
    if cfg.family == "deepseek_v3":
        from engine.models.deepseek_v3 import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM
    raise UnsupportedModelError(f"no model for family {cfg.family!r} ({cfg.architecture})")


def build_model(cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, max_pos: int,
                dp: DPContext | None = None) -> nn.Module:
    """The target model, its parameters in `dtype` (weights not loaded yet)."""
    return model_class(cfg)(cfg, tp, dtype, max_pos=max_pos, dp=dp).to(dtype)
