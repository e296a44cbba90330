"""DeepSeek-V3's own multi-token-prediction layer as a draft head (one layer reused for all k steps).

At index i it reads the target's final hidden state and the embedding of token i+1:

    x   = eh_proj(cat([enorm(embed(token[i+1])), hnorm(hidden[i])]))
    x   = DeepSeek-V3 decoder block(x)     # MLA (its latent row goes to the head's cache layer) + MoE
    out = shared_head.norm(x);  logits = shared_head.head(out)      # -> token i+2

as engine/models/mtp.py does for a Llama-shaped layer (later chain steps feed `out` back). The layer is
`model.layers.{N}.*` (N = num_hidden_layers) of the target's own checkpoint, with the target's config: the
block is a MoE layer (N >= first_k_dense_replace) and caches the same latent row as the target's layers, so
its cache layer extends the target's cache tensor. `embed_tokens`, `shared_head.norm` and `shared_head.head`
fall back to the target's when the checkpoint omits them.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.parallel import TPContext
from engine.errors import ModelLoadError
from engine.layers.linear import ColumnParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3ForCausalLM, layer_weight_names, resolve
from engine.models.draft_head import DraftHead, checkpoint_names, read_config
from engine.models.loader import load_weights
from engine.models.mtp import SHARED, SharedHead, mtp_layer_count
from kernels.norm_rope import rms_norm_cat


class DeepseekMTPHead(DraftHead):
    def __init__(self, cfg: ModelConfig, target: DeepseekV3ForCausalLM, cache_layer: int, tp: TPContext, max_pos: int,
                 present: set[str]):
        """`present`: the layer's checkpoint names (without prefix); shared weights it lacks are the target's."""
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.layer_idx = cfg.num_layers  # the checkpoint's index of the layer (MoE or dense follows from it)
        self.prefix = f"model.layers.{self.layer_idx}."
        self.rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        self.own = {n for n in SHARED if n in present}
        self.embed_tokens = type(target.embed_tokens)(cfg.vocab_size, h) if "embed_tokens.weight" in self.own \
            else target.embed_tokens
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = ColumnParallelLinear(2 * h, h, False, TPContext())  # replicated on every rank
        self.block = DeepseekV3DecoderLayer(cfg, self.layer_idx, tp, self.rotary)
        self.block.self_attn.attn.layer_idx = cache_layer  # its latent rows: the cache layer after the target's
        norm = RMSNorm(h, cfg.rms_norm_eps) if "shared_head.norm.weight" in self.own else target.norm
        head = type(target.lm_head)(cfg.vocab_size, h) if "shared_head.head.weight" in self.own else target.lm_head
        self.shared_head = SharedHead(norm, head)

    def first_hidden(self, final_hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        return final_hidden

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] (the target's final hidden, or this head's previous output), token_ids/positions [T]
        -> the normed state the shared head reads [T, H]."""
        x = self.eh_proj(rms_norm_cat(self.embed_tokens(token_ids), self.enorm.weight, hidden, self.hnorm.weight,
                                      self.enorm.eps))  # one launch on a GPU
        out, residual = self.block(self.rotary.at(positions), x, None)
        return self.shared_head.norm(out, residual)[0]  # norm(out + residual), the add fused into the norm

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(state).float()

    def vocab_head(self) -> nn.Module:
        return self.shared_head.head

    def use_vocab_head(self, head: nn.Module) -> None:
        self.shared_head.head = head

    # loader protocol (engine/models/loader.py)
    def param_for(self, ckpt_name: str):
        if not ckpt_name.startswith(self.prefix):
            return None
        name = ckpt_name[len(self.prefix):]
        if name in SHARED and name not in self.own:
            return None
        if name.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            name = "block." + name
        return resolve(self, name)

    def expected_checkpoint_names(self) -> set[str]:
        names = {"enorm.weight", "hnorm.weight", "eh_proj.weight", *self.own, *layer_weight_names(self.cfg, self.layer_idx)}
        return {self.prefix + n for n in names}


def build_deepseek_mtp(draft_dir: str, cfg: ModelConfig, target: DeepseekV3ForCausalLM, tp: TPContext,
                       dtype: torch.dtype, max_pos: int) -> DeepseekMTPHead:
    """The MTP layer of a DeepSeek-V3 checkpoint (the target's own directory, or one holding only that layer
    under the same names), loaded; parameters on the current default device."""
    raw = read_config(draft_dir)
    mtp_layer_count(raw, draft_dir)
    if raw.get("hidden_size", cfg.hidden_size) != cfg.hidden_size:
        raise ModelLoadError(f"mtp layer {draft_dir} has hidden_size {raw['hidden_size']} but the target has "
                             f"{cfg.hidden_size}")
    prefix = f"model.layers.{cfg.num_layers}."
    present = {n[len(prefix):] for n in checkpoint_names(draft_dir) if n.startswith(prefix)}
    if not present:
        raise ModelLoadError(f"{draft_dir} has no tensors named {prefix}* (the MTP layer after the target's "
                             f"{cfg.num_layers} layers)")
    net = DeepseekMTPHead(cfg, target, cfg.num_layers, tp, max_pos, present).to(dtype)
    load_weights(net, draft_dir, dtype, name_map=lambda n: n if n.startswith(prefix) else None)
    return net
