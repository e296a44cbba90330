"""DeepSeek-V3's own MTP layer over a DeepSeek-V3 target, trained by zoo.distill like the Llama-shaped head.

The formula is zoo.heads.mtp's (`x = eh_proj(cat([enorm(embed(token[i+1])), hnorm(hidden[i])]))`, one decoder
block, `out = shared_head.norm(x)`, `logits = shared_head.head(out)`), but the block is the target's own kind:
transformers' DeepseekV3DecoderLayer with layer index N = num_hidden_layers, so MLA attention and a MoE MLP
(N >= first_k_dense_replace). Its tensors are saved as `model.layers.{N}.*` beside the target's weights, the
layout DeepSeek-V3 checkpoints ship and engine/models/deepseek_mtp.py loads.

Training-time test (zoo.heads.layers' attention pattern): step s > 0 at index i attends to step 0's keys at
indices <= i and to the keys of steps 1..s at index i. MLA computes its keys inside transformers' attention, so
step s runs the block over all steps' inputs concatenated along time, with a mask of that pattern, and keeps
the last segment: earlier segments see exactly what they saw before, so their rows are recomputed unchanged.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from zoo.heads.mtp import FROZEN, share_target_weights



def ttt_mask(t: int, steps: int, device=None) -> torch.Tensor:
    """Additive mask [1, 1, steps*t, steps*t] over the concatenated steps: row (a, i) sees column (0, j) for
    j <= i, and (b, i) for 1 <= b <= a."""
    idx = torch.arange(steps * t, device=device)
    step, pos = idx // t, idx % t
    prefix = (step[None, :] == 0) & (pos[None, :] <= pos[:, None])
    chain = (step[None, :] >= 1) & (step[None, :] <= step[:, None]) & (pos[None, :] == pos[:, None])
    mask = torch.zeros(steps * t, steps * t, device=device)
    return mask.masked_fill(~(prefix | chain), float("-inf"))[None, None]


class SharedHead(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Linear):
        super().__init__()
        self.norm = norm
        self.head = head


class DeepseekMTPLayer(nn.Module):
    kind = "mtp"

    def __init__(self, config):
        """config: the target's DeepseekV3Config."""
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                                                                          DeepseekV3RotaryEmbedding)

        h, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.layer_index = config.num_hidden_layers
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.enorm = DeepseekV3RMSNorm(h, eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(config, layer_idx=self.layer_index)
        self.shared_head = SharedHead(DeepseekV3RMSNorm(h, eps), nn.Linear(h, config.vocab_size, bias=False))
        self.rotary = DeepseekV3RotaryEmbedding(config)

    @classmethod
    def from_target(cls, target, generator: torch.Generator) -> "DeepseekMTPLayer":
        """A fresh layer for an HF DeepseekV3ForCausalLM: embedding, final norm and LM head copied (frozen), norms
        at one, the routing bias at zero, every other weight N(0, initializer_range) drawn from `generator`."""
        head = cls(target.config)
        std = target.config.initializer_range
        with torch.no_grad():
            for name, param in head.named_parameters():
                if name in FROZEN:
                    continue
                if "norm" in name:
                    param.fill_(1.0)
                else:
                    param.normal_(0.0, std, generator=generator)
            for name, buf in head.block.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    buf.zero_()
        share_target_weights(head, target)
        return head

    def first_hidden(self, features: dict) -> torch.Tensor:
        return features["last_hidden"]

    def step_hidden(self, hidden: torch.Tensor, next_tokens: torch.Tensor, positions: torch.Tensor,
                    cache: list) -> torch.Tensor:
        """hidden [B, T, H], next_tokens/positions [B, T] -> out hidden [B, T, H] (post shared_head.norm);
        `cache` collects each step's block input and positions."""
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(next_tokens)), self.hnorm(hidden)), dim=-1))
        cache.append((x, positions))
        t = x.shape[1]
        xs = torch.cat([c[0] for c in cache], dim=1)  # [B, steps*T, H]
        pos = torch.cat([c[1] for c in cache], dim=1)  # [B, steps*T]
        out = self.block(xs, attention_mask=ttt_mask(t, len(cache), x.device).to(xs.dtype), position_ids=pos,
                         position_embeddings=self.rotary(xs, pos))
        return self.shared_head.norm(out[:, -t:])

    def logits_from(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(out)

    def step(self, hidden, next_tokens, positions, cache) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.step_hidden(hidden, next_tokens, positions, cache)
        return out, self.logits_from(out)

    def to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def checkpoint_tensors(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """`model.layers.{N}.*` as DeepSeek-V3 checkpoints name them: the block's names without a prefix and
        its experts one by one (transformers' batched gate_up_proj/down_proj split per expert)."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("rotary.")}
        named = {}
        for key, value in state.items():
            name = key[len("block."):] if key.startswith("block.") else key
            if name == "mlp.experts.gate_up_proj":
                inter = value.shape[1] // 2
                for e in range(value.shape[0]):
                    named[f"mlp.experts.{e}.gate_proj.weight"] = value[e, :inter]
                    named[f"mlp.experts.{e}.up_proj.weight"] = value[e, inter:]
            elif name == "mlp.experts.down_proj":
                for e in range(value.shape[0]):
                    named[f"mlp.experts.{e}.down_proj.weight"] = value[e]
            else:
                named[name] = value
        prefix = f"model.layers.{self.layer_index}."
        return {prefix + k: v.detach().to(dtype).contiguous().clone() for k, v in named.items()}

    def save_beside(self, target_dir: Path, dtype: torch.dtype = torch.float32) -> None:
        """Write the layer into the target's directory as mtp.safetensors and mark the config as having one MTP
        layer (transformers loads model.safetensors only and keeps working)."""
        target_dir = Path(target_dir)
        save_file(self.checkpoint_tensors(dtype), str(target_dir / "mtp.safetensors"), metadata={"format": "pt"})
        config_path = target_dir / "config.json"
        config = json.loads(config_path.read_text())
        config["num_nextn_predict_layers"] = 1
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
