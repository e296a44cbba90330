"""A DeepSeek-V3 multi-token-prediction layer as a draft head (one layer reused for all k steps).

At index i it reads the target's final hidden state (after the final norm: the lm_head input) and
the embedding of token i+1:

    x   = eh_proj(cat([enorm(embed(token[i+1])), hnorm(hidden[i])]))
    x   = Llama decoder block(x)                       # its KV goes to the head's cache layer
    out = shared_head.norm(x);  logits = shared_head.head(out)      # -> token i+2

Later chain steps feed `out` back as the hidden (the post-norm state the lm_head reads, as the
zoo's trainer does). Checkpoint names are `model.layers.{N}.*`, N = the target's num_hidden_layers,
either in the target's own checkpoint or in a directory of their own; `embed_tokens`,
`shared_head.norm` and `shared_head.head` fall back to the target's when the checkpoint omits them.
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
from engine.models.draft_head import BLOCK_WEIGHTS, DraftHead
from engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from kernels.norm_rope import rms_norm_cat

SHARED = {"embed_tokens.weight", "shared_head.norm.weight", "shared_head.head.weight"}


class SharedHead(nn.Module):
    def __init__(self, norm: RMSNorm, head: nn.Module):
        super().__init__()
        self.norm = norm
        self.head = head


class MTPHead(DraftHead):
    def __init__(self, cfg: ModelConfig, target: LlamaForCausalLM, cache_layer: int, tp: TPContext, max_pos: int,
                 present: set[str]):
        """`present`: the head's checkpoint names (without prefix); shared weights it lacks are the target's."""
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.prefix = f"model.layers.{target.cfg.num_layers}."
        self.rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        self.own = {n for n in SHARED if n in present}
        self.embed_tokens = type(target.embed_tokens)(cfg.vocab_size, h) if "embed_tokens.weight" in self.own \
            else target.embed_tokens
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = ColumnParallelLinear(2 * h, h, False, TPContext())  # replicated on every rank
        self.block = LlamaDecoderLayer(cfg, cache_layer, tp, self.rotary)
        norm = RMSNorm(h, cfg.rms_norm_eps) if "shared_head.norm.weight" in self.own else target.norm
        head = type(target.lm_head)(cfg.vocab_size, h) if "shared_head.head.weight" in self.own else target.lm_head
        self.shared_head = SharedHead(norm, head)

    def first_hidden(self, final_hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        return final_hidden

    piecewise = None  # PiecewiseForward (engine/models/piecewise.py) when EngineConfig.cpu_compile is "layers"

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.piecewise is not None:
            done = self.piecewise.run((hidden, token_ids), positions)
            if done is not None:
                return done[0][0]
        # [enorm(embed) | hnorm(hidden)]: one launch on a GPU (two norms and a cat on the reference path)
        x = rms_norm_cat(self.embed_tokens(token_ids), self.enorm.weight, hidden, self.hnorm.weight, self.enorm.eps)
        x = self.eh_proj(x)
        out, residual = self.block(self.rotary.at(positions), x, None)
        return self.shared_head.norm(out, residual)[0]  # norm(out + residual), the add fused into the norm

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(state).float()

    def vocab_head(self) -> nn.Module:
        return self.shared_head.head

    def use_vocab_head(self, head: nn.Module) -> None:
        self.shared_head.head = head  # SharedHead is the MTP's own module, even when its head is the target's

    # loader protocol (engine/models/loader.py)
    def param_for(self, ckpt_name: str):
        if not ckpt_name.startswith(self.prefix):
            return None
        name = ckpt_name[len(self.prefix):]
        if name in SHARED and name not in self.own:
            return None
        if name.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            name = "block." + name
        return self._resolve(name)

    def expected_checkpoint_names(self) -> set[str]:
        names = {"enorm.weight", "hnorm.weight", "eh_proj.weight", *BLOCK_WEIGHTS, *self.own}
        if self.cfg.qkv_bias:
            names |= {"self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"}
        if self.cfg.qk_norm:
            names |= {"self_attn.q_norm.weight", "self_attn.k_norm.weight"}
        return {self.prefix + n for n in names}


def mtp_layer_count(raw: dict, where: str) -> int:
    n = raw.get("num_nextn_predict_layers", 0) or 0
    if n < 1:
        raise ModelLoadError(f"{where} has no MTP layer (config num_nextn_predict_layers is {n})")
    return n
