"""An EAGLE-3 draft head over a Llama target, in the layout its authors publish.

At sequence index i (position i) the head reads three captured target hidden states at i,
concatenated ([B, T, 3H]), and the target embedding of token i+1, and computes (as EAGLE-3, vLLM's
and SGLang's `LlamaForCausalLMEagle3` do):

    g   = fc(cat(aux_0, aux_1, aux_2))                       # [H], first step only
    x   = cat([input_layernorm(embed(token[i+1])), hidden_norm(g)], -1)   # 2H wide
    x   = g + self_attn(x)                                   # q/k/v_proj in_features = 2H
    x   = x + mlp(post_attention_layernorm(x))               # `x` is the pre-norm output
    logits_draft = lm_head(norm(x))                          # [draft_vocab]; -> token i+2

Chained drafting feeds the pre-norm `x` back as g for the next step (no fc), at position i+d-1.
Draft ids map to target ids by `target = draft + d2t[draft]`; `t2d[target]` says whether a target
id is in the draft vocabulary.

Captured layers: `eagle_config.eagle_aux_hidden_state_layer_ids` in vLLM's convention: id j is HF
`output_hidden_states[j]`, the output of decoder layer j-1 (0-based; j = 0 would be the
embeddings). The default (2, L//2, L-3) captures the outputs of layers 1, L/2-1 and L-4; targets
with fewer than 7 layers get three ids spread over 1..L-1.

Checkpoint (config.json + model.safetensors), no embed_tokens (the target's embedding is used):
    fc.weight                                   [H, 3H]
    midlayer.hidden_norm.weight                 [H]
    midlayer.input_layernorm.weight             [H]
    midlayer.self_attn.q_proj.weight            [heads*head_dim, 2H]
    midlayer.self_attn.{k,v}_proj.weight        [kv_heads*head_dim, 2H]
    midlayer.self_attn.o_proj.weight            [H, heads*head_dim]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up}_proj.weight          [I, H];  midlayer.mlp.down_proj.weight [H, I]
    norm.weight                                 [H]
    lm_head.weight                              [draft_vocab_size, H]
    d2t                                         int64 [draft_vocab_size]
    t2d                                         bool  [vocab_size]
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from zoo.heads.layers import MLP, Attention, RMSNorm, init_linear_, rope_theta_of
from zoo.token_map import hot_token_ids

EAGLE3_WEIGHT_NAMES = (
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
    "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.mlp.gate_proj.weight",
    "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "norm.weight",
    "lm_head.weight", "d2t", "t2d",
)
_TARGET_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "rope_parameters", "rope_theta", "max_position_embeddings", "vocab_size",
    "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "initializer_range",
)


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default capture ids (2, L//2, L-3). Targets too shallow for three distinct ids (L < 7)
    get ids spread evenly over 1..L-1 instead: vLLM captures id j before running layer j, so an id
    must stay below L (id L, the last layer's output, is never captured there)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 1:
        return ids
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 needs a target with at least 4 layers, got {num_layers}")
    return [1 + round(k * (num_layers - 2) / 2) for k in range(3)]


def draft_vocab(token_counts: torch.Tensor, draft_vocab_size: int, always: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent target ids (ties -> lower id) plus `always`."""
    used = torch.tensor(hot_token_ids(token_counts, draft_vocab_size, always), dtype=torch.int64)
    d2t = used - torch.arange(draft_vocab_size, dtype=torch.int64)
    t2d = torch.zeros(len(token_counts), dtype=torch.bool)
    t2d[used] = True
    return d2t, t2d


class Eagle3Layer(nn.Module):
    def __init__(self, h: int, intermediate: int, heads: int, kv_heads: int, head_dim: int, eps: float, theta: float):
        super().__init__()
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(2 * h, h, heads, kv_heads, head_dim, theta)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, intermediate)


class Eagle3Head(nn.Module):
    kind = "eagle3"

    def __init__(self, config: dict, embed_tokens: nn.Embedding | None = None):
        super().__init__()
        h, eps = config["hidden_size"], config["rms_norm_eps"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or h // heads
        self.config = dict(config)
        self.aux_layer_ids = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        self.fc = nn.Linear(3 * config.get("target_hidden_size", h), h, bias=False)
        self.midlayer = Eagle3Layer(h, config["intermediate_size"], heads, config["num_key_value_heads"],
                                    head_dim, eps, rope_theta_of(config))
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, config["draft_vocab_size"], bias=False)
        self.register_buffer("d2t", torch.zeros(config["draft_vocab_size"], dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(config["vocab_size"], dtype=torch.bool))
        # The target's embedding, frozen and not part of this module's state (published heads omit it).
        self._embed = [embed_tokens]

    @classmethod
    def from_target(cls, target, d2t: torch.Tensor, t2d: torch.Tensor, aux_layer_ids: list[int],
                    generator: torch.Generator) -> "Eagle3Head":
        base = target.config.to_dict()
        config = {k: base[k] for k in _TARGET_KEYS if k in base}
        config.update({
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
            "tie_word_embeddings": False, "draft_vocab_size": int(d2t.numel()),
            "target_hidden_size": base["hidden_size"], "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
        })
        head = cls(config, target.get_input_embeddings())
        init_linear_(head, base["initializer_range"], generator)
        with torch.no_grad():
            head.d2t.copy_(d2t)
            head.t2d.copy_(t2d)
            # Start the draft lm_head from the target's rows for the draft vocabulary.
            rows = target.get_output_embeddings().weight
            head.lm_head.weight.copy_(rows[(d2t + torch.arange(d2t.numel())).to(rows.device)])
        return head

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        if self._embed[0] is None:
            raise RuntimeError("Eagle3Head needs the target's embedding: pass embed_tokens")
        return self._embed[0](tokens).detach().to(self.norm.weight.dtype)

    def step_hidden(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                    cache: list) -> torch.Tensor:
        """hidden [B, T, 3H] (first step) or [B, T, H] -> pre-norm out [B, T, H]."""
        if hidden.shape[-1] != self.norm.weight.shape[0]:
            hidden = self.fc(hidden)
        layer = self.midlayer
        x = torch.cat((layer.input_layernorm(self.embed(next_tokens)), layer.hidden_norm(hidden)), dim=-1)
        x = hidden + layer.self_attn(x, positions, cache)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def logits_from(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))

    def step(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
             cache: list) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (pre-norm out [B, T, H], draft logits [B, T, draft_vocab])."""
        x = self.step_hidden(hidden, next_tokens, positions, cache)
        return x, self.logits_from(x)

    def first_hidden(self, features: dict) -> torch.Tensor:
        return features["aux_hidden"]

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., draft_vocab] -> target-vocab logits (-inf outside the draft vocab)."""
        ids = torch.arange(self.d2t.numel(), device=logits.device) + self.d2t
        out = logits.new_full((*logits.shape[:-1], self.t2d.numel()), float("-inf"))
        out[..., ids] = logits
        return out

    def save(self, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        """Float tensors are stored in `dtype` (d2t/t2d keep theirs); the config says float32."""
        out_dir.mkdir(parents=True, exist_ok=True)
        state = {k: _stored(v, dtype) for k, v in self.state_dict().items()}
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        (out_dir / "config.json").write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, head_dir: Path, embed_tokens: nn.Embedding | None = None) -> "Eagle3Head":
        config = json.loads((Path(head_dir) / "config.json").read_text())
        head = cls(config, embed_tokens)
        head.load_state_dict(load_file(str(Path(head_dir) / "model.safetensors")))
        return head


def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous().clone()
