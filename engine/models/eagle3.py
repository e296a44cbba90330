"""An EAGLE-3 draft head in the layout its authors publish (`LlamaForCausalLMEagle3`).

At index i the first chain step reads three target layer outputs at i, concatenated [3H], and the
target's embedding of token i+1:

    g   = fc(cat(aux_0, aux_1, aux_2))                                # first step only
    x   = g + self_attn(cat([input_layernorm(embed(token[i+1])), hidden_norm(g)]))   # q/k/v read 2H
    x   = x + mlp(post_attention_layernorm(x))                        # the state fed back (pre-norm)
    logits = lm_head(norm(x))                                         # draft vocab -> token i+2

Draft id d is target id d + d2t[d]. Captured layers follow vLLM's ids: id j is the output of
decoder layer j-1; the default (2, L//2, L-3) reads layers 1, L/2-1 and L-4, and the checkpoint's
`eagle_config.eagle_aux_hidden_state_layer_ids` wins. `embed_tokens` and `lm_head` fall back to the
target's when the checkpoint omits them (the lm_head then takes the target's rows of the draft vocab).
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.parallel import TPContext
from engine.errors import ModelLoadError
from engine.layers.linear import ColumnParallelLinear, LMHead, QKVParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding
from engine.models.draft_head import BLOCK_WEIGHTS, DraftHead
from engine.models.llama import LlamaAttention, LlamaMLP, LlamaForCausalLM
from kernels.norm_rope import rms_norm_cat


def aux_layer_ids(raw: dict, num_target_layers: int) -> list[int]:
    """The capture ids (vLLM convention) from the head's config, else the default; validated."""
    L = num_target_layers
    ids = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3]
    ids = [int(i) for i in ids]
    if len(ids) != 3 or not all(1 <= i <= L for i in ids):
        raise ModelLoadError(f"EAGLE-3 aux hidden-state layer ids {ids} must be three ids in 1..{L} for a "
                             f"{L}-layer target; set eagle_config.eagle_aux_hidden_state_layer_ids")
    return ids


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, cache_layer: int, tp: TPContext, rotary: RotaryEmbedding):
        super().__init__()
        h = cfg.hidden_size
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, cache_layer, tp, rotary)
        # q/k/v read [embedding; hidden], twice the model width; o_proj writes the model width.
        self.self_attn.qkv_proj = QKVParallelLinear(2 * h, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                                    cfg.qkv_bias, tp)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)


class Eagle3Head(DraftHead):
    def __init__(self, cfg: ModelConfig, raw: dict, target: LlamaForCausalLM, cache_layer: int, tp: TPContext,
                 max_pos: int, present: set[str]):
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.draft_vocab_size = int(raw.get("draft_vocab_size") or cfg.vocab_size)
        self.aux_ids = aux_layer_ids(raw, target.cfg.num_layers)
        self.capture_layers = tuple(i - 1 for i in self.aux_ids)
        target_h = int(raw.get("target_hidden_size") or target.cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        self.own_embed = "embed_tokens.weight" in present
        self.own_head = "lm_head.weight" in present
        self.embed_tokens = type(target.embed_tokens)(target.cfg.vocab_size, h) if self.own_embed \
            else target.embed_tokens
        self.fc = ColumnParallelLinear(3 * target_h, h, False, TPContext())  # replicated on every rank
        self.midlayer = Eagle3Layer(cfg, cache_layer, tp, self.rotary)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = LMHead(self.draft_vocab_size, h) if self.own_head else None
        self._target_head = target.lm_head
        self.register_buffer("draft_to_target", torch.arange(self.draft_vocab_size), persistent=False)

    def set_vocab_map(self, d2t: torch.Tensor | None, target_vocab: int) -> None:
        """d2t [draft_vocab] int64 offsets (None: identity). Without an lm_head of its own, the head
        reads the target's rows of its vocabulary."""
        if d2t is None:
            if self.draft_vocab_size != target_vocab:
                raise ModelLoadError(f"EAGLE-3 checkpoint has draft_vocab_size {self.draft_vocab_size} < "
                                     f"{target_vocab} but no 'd2t' tensor mapping draft ids to target ids")
            return
        if tuple(d2t.shape) != (self.draft_vocab_size,) or d2t.is_floating_point():
            raise ModelLoadError(f"weight 'd2t' has shape {tuple(d2t.shape)} and dtype {d2t.dtype}, expected "
                                 f"({self.draft_vocab_size},) integers")
        ids = torch.arange(self.draft_vocab_size, device="cpu") + d2t.long().cpu()  # on CPU under any default device
        if int(ids.min()) < 0 or int(ids.max()) >= target_vocab:
            raise ModelLoadError(f"weight 'd2t' maps draft ids outside the target vocabulary [0, {target_vocab})")
        self.draft_to_target.copy_(ids)
        if self.lm_head is None and self.draft_vocab_size != target_vocab:
            self.lm_head = LMHead(self.draft_vocab_size, self.cfg.hidden_size).to(self._target_head.weight)
            self.lm_head.weight.data.copy_(self._target_head.weight.data[ids.to(self._target_head.weight.device)])

    def first_hidden(self, final_hidden: torch.Tensor, captured: list[torch.Tensor]) -> torch.Tensor:
        by_layer = dict(zip(sorted(set(self.capture_layers)), captured))
        return torch.cat([by_layer[i] for i in self.capture_layers], dim=-1)

    def forward(self, hidden: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if hidden.shape[-1] != self.norm.weight.shape[0]:  # the first step reads the 3 target layers
            hidden = self.fc(hidden)
        layer = self.midlayer
        # [input_layernorm(embed) | hidden_norm(hidden)]: one launch on a GPU (two norms and a cat on the reference)
        x = rms_norm_cat(self.embed_tokens(token_ids), layer.input_layernorm.weight, hidden, layer.hidden_norm.weight,
                         layer.input_layernorm.eps)
        x = hidden + layer.self_attn(self.rotary.at(positions), x)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def compute_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.vocab_head()(self.norm(state)).float()

    def vocab_head(self) -> nn.Module:
        return self.lm_head if self.lm_head is not None else self._target_head

    def use_vocab_head(self, head: nn.Module) -> None:
        self.lm_head = head

    # loader protocol (engine/models/loader.py)
    def param_for(self, ckpt_name: str):
        if ckpt_name == "embed_tokens.weight" and not self.own_embed:
            return None
        return self._resolve(ckpt_name)

    def expected_checkpoint_names(self) -> set[str]:
        names = {"fc.weight", "norm.weight", "midlayer.hidden_norm.weight"}
        names |= {"midlayer." + n for n in BLOCK_WEIGHTS}
        if self.cfg.qkv_bias:
            names |= {"midlayer.self_attn.q_proj.bias", "midlayer.self_attn.k_proj.bias",
                      "midlayer.self_attn.v_proj.bias"}
        if self.own_embed:
            names.add("embed_tokens.weight")
        if self.own_head:
            names.add("lm_head.weight")
        return names
