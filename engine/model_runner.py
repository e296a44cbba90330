"""Owns the model and the KV cache of one process and runs one step: inputs -> forward -> logits -> sample."""
from __future__ import annotations

import logging

import torch

from engine.attention import attention_context
from engine.batch import ModelInputs, build_inputs
from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig
from engine.loader import load_weights
from engine.models.llama import LlamaForCausalLM
from engine.parallel import TPContext
from engine.sampler import SamplerOutput, sample
from engine.scheduler import ScheduledRequest

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_cfg: ModelConfig, tp: TPContext, max_model_len: int):
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.device = torch.device(cfg.device)
        self.dtype = cfg.torch_dtype(model_cfg)
        spec = cfg.speculative
        # Draft chains and padded verification rows may run up to 2k + 1 positions past the last token.
        max_pos = max_model_len + (2 * spec.k + 2 if spec is not None else 0)
        with torch.device(self.device):
            self.model = LlamaForCausalLM(model_cfg, tp, self.dtype, max_pos=max_pos).to(self.dtype)
        load_weights(self.model, cfg.model, self.dtype)
        self.model.eval()
        self.num_kv_heads = self.model.layers[0].self_attn.attn.num_kv_heads
        self.kv_cache: torch.Tensor | None = None
        self.spec = None
        if spec is not None:
            from engine.spec.runner import SpecRunner

            self.spec = SpecRunner(cfg, spec, model_cfg, self.model, tp, self.dtype, self.device, max_pos,
                                   self.num_kv_heads)

    @property
    def num_cache_layers(self) -> int:
        """Layers of the cache tensor: the target's, then the draft's when they share its shape."""
        return self.model_cfg.num_layers + (self.spec.num_shared_layers if self.spec is not None else 0)

    def kv_block_bytes(self) -> int:
        m = self.model_cfg
        per = 2 * self.num_cache_layers * self.cfg.block_size * self.num_kv_heads * m.head_dim * self.dtype.itemsize
        return per + (self.spec.separate_block_bytes(self.cfg.block_size, self.dtype) if self.spec is not None else 0)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        m = self.model_cfg
        shape = (self.num_cache_layers, 2, num_blocks, self.cfg.block_size, self.num_kv_heads, m.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.spec is not None:
            self.spec.attach_caches(self.kv_cache, num_blocks, self.cfg.block_size, self.dtype)
        return self.kv_cache

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledRequest], blocks: BlockManager) -> tuple[SamplerOutput | None, ModelInputs]:
        inputs = build_inputs(scheduled, blocks, self.kv_cache, self.device, self.model_cfg.vocab_size)
        with attention_context(inputs.attn):
            hidden, _ = self.model(inputs.input_ids, inputs.positions)
        if inputs.sampling is None:
            return None, inputs
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        return sample(logits, inputs.sampling), inputs
