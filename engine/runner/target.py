"""The target model of one process, loaded: built for its sharding, weights read, its matmuls laid out for
verification rows. The engine loads it, builds its drafter beside it (a draft head shares its embeddings and
LM head: engine/speculative/drafter.py) and hands both to the model runner, which runs them."""
from __future__ import annotations

import logging

import torch

from engine.config import EngineConfig, ModelConfig, position_margin
from engine.distributed.data_parallel import DPContext
from engine.distributed.parallel import TPContext
from engine.errors import UnsupportedModelError
from engine.layers.linear import VERIFY_ROWS_BUDGET, matvec_layout
from engine.models.loader import load_weights
from engine.models.registry import build_model
from engine.speculative.loading import DraftTarget

log = logging.getLogger(__name__)


def load_target(cfg: EngineConfig, model_cfg: ModelConfig, tp: TPContext, max_model_len: int,
                dp: DPContext | None = None) -> DraftTarget:
    """tp: attention's sharding (and the draft network's); dp: the attention-data-parallel group (then tp is
    size 1). UnsupportedModelError for a speculation method the target's architecture cannot draft with."""
    spec = cfg.speculative
    if model_cfg.mla is not None and spec is not None and spec.method in ("eagle3", "draft_model"):
        raise UnsupportedModelError(f"speculative method {spec.method!r} is not built for MLA targets yet; use "
                                    f"'mtp' (the checkpoint's own layer), 'ngram' or 'grammar'")
    device = torch.device(cfg.device)
    dtype = cfg.torch_dtype(model_cfg)
    if device.type == "cpu" and dtype == torch.bfloat16:
        # Measured on a 2-core AMD EPYC with avx512_bf16 (bench/results/real_decode_quiet_cpu.md): SmolLM2 bf16
        # decoded at 1.7 tok/s eager and 4.5 compiled, fp32 at 13.9 and 22.2. Said once per load, not refused:
        # another CPU or torch build may do better, and bf16 halves the weights' memory.
        log.warning("bf16 on CPU: this torch build's bf16 matmuls ran 5-8x slower than fp32 where measured "
                    "(bench/results/real_decode_quiet_cpu.md); pass dtype='float32' (--dtype float32) for speed, "
                    "with weight_dtype='bfloat16' and cpu_compile='full' for bf16 weights read in fp32 arithmetic")
    if cfg.weight_dtype is not None and dtype != torch.float32:
        raise ValueError(f"weight_dtype={cfg.weight_dtype!r} computes in float32 around {cfg.weight_dtype} weights; the "
                         f"engine's dtype resolved to {dtype}: pass dtype='float32' (--dtype float32)")
    # Draft chains and padded verification rows run past the last token: the rope table covers them.
    k = spec.num_nodes if spec is not None else 0  # a tree's rows: num_nodes >= k
    max_pos = max_model_len + position_margin(k)
    with torch.device(device):
        model = build_model(model_cfg, tp, dtype, max_pos, dp)
    load_weights(model, cfg.model, dtype, getattr(model, "name_map", None))
    matvec_layout(model, VERIFY_ROWS_BUDGET if k else 0)
    model.eval()
    # What one layer caches per token, as the model states it (KV heads, or MLA's latent row).
    return DraftTarget(cfg, model_cfg, model, tp, dtype, device, max_pos, model.kv_cache_spec().heads)
