"""A DeepSeek-V3 multi-token-prediction (MTP) head over a Llama target, and its checkpoint format.

One MTP module predicts the token after next. At sequence index i (position i) it reads
- the target's last hidden state at i, AFTER the target's final norm (the lm_head input), and
- the embedding of token i+1 (the token the target just emitted),
and computes, as DeepSeek-V3 / vLLM / SGLang do:

    x   = eh_proj(cat([enorm(embed(token[i+1])), hnorm(hidden[i])], -1))     # [embedding; hidden]
    x   = x + self_attn(input_layernorm(x))                                   # Llama block
    x   = x + mlp(post_attention_layernorm(x))
    out = shared_head.norm(x);  logits = shared_head.head(out)               # -> token i+2

Chained drafting (depth d > 1) feeds `out` back as the hidden of the next step (SGLang's
convention: the head's own lm_head input, post-norm), at position i+d-1.

Checkpoint (directory with config.json + model.safetensors), N = target num_hidden_layers:
    model.layers.{N}.embed_tokens.weight            [V, H]   copy of the target's embedding
    model.layers.{N}.enorm.weight, .hnorm.weight    [H]
    model.layers.{N}.eh_proj.weight                 [H, 2H]
    model.layers.{N}.input_layernorm.weight         [H]
    model.layers.{N}.self_attn.{q,k,v,o}_proj.weight
    model.layers.{N}.post_attention_layernorm.weight [H]
    model.layers.{N}.mlp.{gate,up,down}_proj.weight
    model.layers.{N}.shared_head.norm.weight        [H]      copy of the target's final norm
    model.layers.{N}.shared_head.head.weight        [V, H]   copy of the target's lm_head
config.json = the target's Llama config plus "num_nextn_predict_layers": 1.
Embedding, shared_head.norm and shared_head.head stay frozen (equal to the target's) in training.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from zoo.heads.layers import MLP, Attention, RMSNorm, rope_theta_of

MTP_MODULE_NAMES = (
    "embed_tokens.weight", "enorm.weight", "hnorm.weight", "eh_proj.weight",
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
    "shared_head.norm.weight", "shared_head.head.weight",
)
FROZEN = ("embed_tokens.weight", "shared_head.norm.weight", "shared_head.head.weight")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False)


class MTPHead(nn.Module):
    kind = "mtp"

    def __init__(self, config: dict):
        super().__init__()
        h, eps = config["hidden_size"], config["rms_norm_eps"]
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or h // heads
        self.config = dict(config)
        self.layer_index = config["num_hidden_layers"]
        self.embed_tokens = nn.Embedding(config["vocab_size"], h)
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Attention(h, h, heads, config["num_key_value_heads"], head_dim, rope_theta_of(config))
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = MLP(h, config["intermediate_size"])
        self.shared_head = SharedHead(h, config["vocab_size"], eps)

    @classmethod
    def from_target(cls, target, generator: torch.Generator) -> "MTPHead":
        """A fresh head for an HF Llama `target`: shared weights copied, the rest initialized."""
        head = cls(target.config.to_dict())
        std = target.config.initializer_range
        for module in (head.eh_proj, head.self_attn, head.mlp):
            for sub in module.modules():
                if isinstance(sub, nn.Linear):
                    with torch.no_grad():
                        sub.weight.normal_(0.0, std, generator=generator)
        share_target_weights(head, target)
        return head

    def step_hidden(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                    cache: list) -> torch.Tensor:
        """hidden [B, T, H], next_tokens/positions [B, T] -> out hidden [B, T, H] (post shared_head.norm)."""
        x = torch.cat((self.enorm(self.embed_tokens(next_tokens)), self.hnorm(hidden)), dim=-1)
        x = self.eh_proj(x)
        x = x + self.self_attn(self.input_layernorm(x), positions, cache)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return self.shared_head.norm(x)

    def logits_from(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(out)

    def step(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
             cache: list) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (out hidden [B, T, H], logits [B, T, V])."""
        out = self.step_hidden(hidden, next_tokens, positions, cache)
        return out, self.logits_from(out)

    def first_hidden(self, features: dict) -> torch.Tensor:
        return features["last_hidden"]

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def save(self, out_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        """Float tensors are stored in `dtype` (d2t/t2d keep theirs); the config says float32."""
        out_dir.mkdir(parents=True, exist_ok=True)
        prefix = f"model.layers.{self.layer_index}."
        state = {prefix + k: _stored(v, dtype) for k, v in self.state_dict().items()}
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
        config = dict(self.config)
        config["num_nextn_predict_layers"] = 1
        config["architectures"] = ["LlamaForCausalLM"]
        (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, head_dir: Path) -> "MTPHead":
        config = json.loads((Path(head_dir) / "config.json").read_text())
        head = cls(config)
        prefix = f"model.layers.{head.layer_index}."
        state = load_file(str(Path(head_dir) / "model.safetensors"))
        head.load_state_dict({k[len(prefix):]: v for k, v in state.items()})
        return head


def _stored(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    tensor = tensor.detach()
    return (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous().clone()


def share_target_weights(head: nn.Module, target) -> None:
    """An MTP head's copies of the target's embeddings, output head and final norm (DeepSeek-V3 shares them), kept
    frozen in training (FROZEN); every other parameter trains."""
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.shared_head.head.weight.copy_(target.get_output_embeddings().weight)
        head.shared_head.norm.weight.copy_(target.model.norm.weight)
    for name, param in head.named_parameters():
        param.requires_grad_(name not in FROZEN)
