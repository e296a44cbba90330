"""Building a draft network from its checkpoint: MTP, EAGLE-3 or a separate draft model.

Every problem with a draft checkpoint (missing directory, config or weight; a tensor of the wrong
shape; a head made for another target) is a ModelLoadError that names it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.config import EngineConfig, ModelConfig, SpecConfig
from engine.distributed.parallel import TPContext
from engine.errors import ModelLoadError
from engine.layers.linear import VERIFY_ROWS_BUDGET, matvec_layout
from engine.models.draft_head import check_dims, checkpoint_names, head_model_config, read_config, read_tensor
from engine.models.eagle3 import Eagle3Head
from engine.models.llama import LlamaForCausalLM
from engine.models.loader import load_weights
from engine.models.mtp import MTPHead, mtp_layer_count
from engine.speculative.proposer import DraftModelProposer, HeadProposer, Proposer
from engine.speculative.token_map import read_token_map

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class DraftTarget:
    """The target a drafter drafts for, as engine/runner/target.py loaded it: what a draft network is built
    beside (a head shares its embeddings and LM head) and sized by, and what the model runner runs."""

    cfg: EngineConfig
    model_cfg: ModelConfig
    model: LlamaForCausalLM
    tp: TPContext  # attention's sharding, which the draft network's follows
    dtype: torch.dtype
    device: torch.device
    max_pos: int  # the rope table's length (draft chains run past the last token)
    num_kv_heads: int  # the target's KV heads on this rank


def load_proposer(spec: SpecConfig, target: DraftTarget, kv_cache_ref) -> tuple[Proposer, tuple[int, int], bool]:
    """-> (proposer, (kv heads, head dim) of its KV layers, whether they extend the target's cache).
    kv_cache_ref: callable -> the cache tensor holding the draft's layers."""
    cfg, model_cfg, tp, dtype, device, max_pos = (target.cfg, target.model_cfg, target.tp, target.dtype, target.device,
                                                  target.max_pos)
    num_kv_heads, target = target.num_kv_heads, target.model
    draft_dir = spec.draft or cfg.model
    if model_cfg.mla is not None and spec.method == "mtp":
        # DeepSeek-V3's own MTP layer (MLA + MoE, the target's config): its latent rows extend the target's cache
        from engine.models.deepseek_mtp import build_deepseek_mtp

        with torch.device(device):
            net = build_deepseek_mtp(draft_dir, model_cfg, target, tp, dtype, max_pos)
        matvec_layout(net, VERIFY_ROWS_BUDGET)
        return _head_proposer(net, spec, model_cfg.vocab_size, kv_cache_ref), (num_kv_heads, model_cfg.head_dim), True
    if spec.method == "draft_model":
        dcfg = ModelConfig.from_dir(draft_dir)
    else:
        raw = read_config(draft_dir)
        dcfg = head_model_config(draft_dir, raw)
        check_dims(f"{spec.method} head {draft_dir}", dcfg, model_cfg)
    kv_shape = (max(1, dcfg.num_kv_heads // tp.size), dcfg.head_dim)
    shares = kv_shape == (num_kv_heads, model_cfg.head_dim)
    first_layer = model_cfg.num_layers if shares else 0

    with torch.device(device):
        if spec.method == "mtp":
            mtp_layer_count(raw, draft_dir)
            prefix = f"model.layers.{model_cfg.num_layers}."
            present = {n[len(prefix):] for n in checkpoint_names(draft_dir) if n.startswith(prefix)}
            if not present:
                raise ModelLoadError(f"{draft_dir} has no tensors named {prefix}* (the MTP layer after the "
                                     f"target's {model_cfg.num_layers} layers)")
            net = MTPHead(dcfg, target, first_layer, tp, max_pos, present).to(dtype)
            load_weights(net, draft_dir, dtype, name_map=lambda n: n if n.startswith(prefix) else None)
            proposer = _head_proposer(net, spec, model_cfg.vocab_size, kv_cache_ref)
        elif spec.method == "eagle3":
            if "LlamaForCausalLMEagle3" not in (raw.get("architectures") or []):
                log.warning("%s does not declare LlamaForCausalLMEagle3; reading it as an EAGLE-3 head", draft_dir)
            net = Eagle3Head(dcfg, raw, target, first_layer, tp, max_pos, checkpoint_names(draft_dir)).to(dtype)
            load_weights(net, draft_dir, dtype, name_map=lambda n: None if n in ("d2t", "t2d") else n)
            net.set_vocab_map(read_tensor(draft_dir, "d2t"), model_cfg.vocab_size)
            proposer = _head_proposer(net, spec, model_cfg.vocab_size, kv_cache_ref)
        else:
            if dcfg.vocab_size != model_cfg.vocab_size:
                log.warning("draft model vocabulary %d differs from the target's %d; ids past the smaller one "
                            "are never drafted", dcfg.vocab_size, model_cfg.vocab_size)
            net = LlamaForCausalLM(dcfg, tp, dtype, max_pos=max_pos).to(dtype)
            load_weights(net, draft_dir, dtype)
            for layer in net.layers:  # the draft's KV layers come after the target's
                layer.self_attn.attn.layer_idx += first_layer
            proposer = DraftModelProposer(net.eval(), spec.k, model_cfg.vocab_size, kv_cache_ref)
    matvec_layout(net, VERIFY_ROWS_BUDGET)  # its first pass verifies k+1 rows per request
    return proposer, kv_shape, shares


def _head_proposer(head, spec: SpecConfig, vocab_size: int, kv_cache_ref) -> HeadProposer:
    """The head drafting from its token map when the config names one (before the proposer reads its vocabulary)."""
    if spec.token_map is not None:
        ids = read_token_map(spec.token_map, vocab_size)
        head.restrict_vocab(ids, vocab_size, spec.token_map)
        log.info("%s head drafts from %d of %d token ids (token map %s)", spec.method, ids.numel(), vocab_size,
                 spec.token_map)
    return HeadProposer(head.eval(), spec.k, vocab_size, kv_cache_ref)
