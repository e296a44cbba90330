"""DeepSeek-V3 (`DeepseekV3ForCausalLM`): multi-head latent attention over a latent paged cache
(engine/models/mla.py) and a mixture of experts (engine/layers/moe.py) after `first_k_dense_replace` dense
layers. Loads HF checkpoints under the names transformers uses (experts one by one,
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight`, into batched expert weights).

The forward has the Llama family's interface: a flattened varlen batch ([T] tokens of any mix of prefill
chunks, decode tokens and verification chains) with no host syncs or data-dependent shapes. The MTP layer
a checkpoint may carry (`model.layers.{num_hidden_layers}.*`) is not part of the target and is skipped here.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.data_parallel import DPContext
from engine.distributed.parallel import TPContext
from engine.errors import UnsupportedModelError
from engine.layers.kv_spec import KVCacheSpec
from engine.layers.linear import Embedding, LMHead
from engine.layers.moe import EXPERT_PARTS, MoEBlock
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeAt, RotaryEmbedding
from engine.models.llama import LlamaMLP
from engine.models.mla import MLAttention

_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")
_GATE_UP = {".gate_proj.": 0, ".up_proj.": 1}  # dense and shared-expert MLPs: checkpoint part -> fused shard


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPContext, rotary: RotaryEmbedding,
                 dp: DPContext | None = None):
        super().__init__()
        self.self_attn = MLAttention(cfg, layer_idx, tp, rotary)
        self.mlp = (MoEBlock(cfg.hidden_size, cfg.moe, tp, dp) if cfg.moe.is_moe_layer(layer_idx)
                    else LlamaMLP(cfg, tp, dp))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: RopeAt, hidden: torch.Tensor, residual: torch.Tensor | None):
        """Pre-norm block on the residual stream; returns (block output, residual) unsummed."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden, residual = self.post_attention_layernorm(self.self_attn(rope, hidden), residual)
        return self.mlp(hidden), residual


class DeepseekV3ForCausalLM(nn.Module):
    piecewise = None  # no piecewise CPU compilation for this family (EngineConfig.cpu_compile "layers" packs GEMMs only)

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, max_pos: int,
                 dp: DPContext | None = None):
        super().__init__()
        if cfg.mla is None or cfg.moe is None:
            raise UnsupportedModelError(f"{cfg.architecture} needs an MLA and MoE config")
        if cfg.hidden_act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg.hidden_act!r}; only 'silu' is implemented")
        self.cfg = cfg
        self.dp = dp
        self.rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(cfg, i, tp, self.rotary, dp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def kv_cache_spec(self) -> KVCacheSpec:
        return self.layers[0].self_attn.attn.kv_cache_spec()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions [T] -> (final normed hidden [T, hidden], the residual stream after each layer
        in `capture_layers`, in that order)."""
        hidden, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.at(positions)
        captured: list[torch.Tensor] = []
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(rope, hidden, residual)
            if i in capture_layers:
                captured.append(hidden + residual)
        hidden, _ = self.norm(hidden, residual)
        return hidden, captured

    def idle_forward(self, dtype: torch.dtype, device: torch.device) -> None:
        """ADP: this rank has no rows in a step where others do; its MLP and MoE shards still serve theirs."""
        assert self.dp is not None
        empty = torch.empty(0, self.cfg.hidden_size, dtype=dtype, device=device)
        for layer in self.layers:
            layer.mlp(empty)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, V] in fp32."""
        return self.lm_head(hidden).float()

    # ------------------------------------------------------------------ checkpoint names
    def name_map(self, name: str) -> str | None:
        """The loader's filter: the MTP layer(s) after the target's layers belong to the draft head."""
        m = _LAYER.match(name)
        return None if m is not None and int(m.group(1)) >= self.cfg.num_layers else name

    def param_for(self, ckpt_name: str) -> tuple[nn.Module, str, object] | None:
        """Map a checkpoint tensor name to (module that loads it, param name, shard id); None to skip."""
        name = ckpt_name.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return None
        return resolve(self, name)

    def expected_checkpoint_names(self) -> set[str]:
        """Every tensor name a complete checkpoint of this config must carry."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.cfg.tie_word_embeddings:
            names.add("lm_head.weight")
        for i in range(self.cfg.num_layers):
            names.update(f"model.layers.{i}.{n}" for n in layer_weight_names(self.cfg, i))
        return names


def resolve(root: nn.Module, name: str) -> tuple[nn.Module, str, object] | None:
    """A checkpoint name relative to `root`'s module tree (after any prefix is mapped) -> (module, leaf, shard
    id): one expert's weight -> the batched experts (shard (expert, part)); gate/up of a dense or shared MLP ->
    the fused gate_up_proj; anything else by its path."""
    shard = None
    expert = _EXPERT.match(name)
    if expert is not None:
        module_path, leaf = expert.group(1), "w2" if expert.group(3) == "down_proj" else "w13"
        shard = (int(expert.group(2)), EXPERT_PARTS.index(expert.group(3)))
    else:
        for frag, sid in _GATE_UP.items():
            if ".mlp." in name and frag in name:
                name, shard = name.replace(frag, ".gate_up_proj."), sid
                break
        module_path, _, leaf = name.rpartition(".")
    try:
        module = root.get_submodule(module_path)
    except AttributeError:
        return None
    if getattr(module, leaf, None) is None:
        return None
    return module, leaf, shard


def layer_weight_names(cfg: ModelConfig, layer_idx: int) -> list[str]:
    """The checkpoint names of decoder layer `layer_idx`, relative to `model.layers.{layer_idx}.`."""
    mla, moe = cfg.mla, cfg.moe
    attn = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"]
    attn += ["q_proj.weight"] if mla.q_lora_rank is None else ["q_a_proj.weight", "q_a_layernorm.weight",
                                                               "q_b_proj.weight"]
    if mla.attention_bias:
        attn += ["kv_a_proj_with_mqa.bias", "o_proj.bias"] + ([] if mla.q_lora_rank is None else ["q_a_proj.bias"])
    names = ["input_layernorm.weight", "post_attention_layernorm.weight"] + [f"self_attn.{p}" for p in attn]
    mlp = [f"{p}.weight" for p in EXPERT_PARTS]
    if not moe.is_moe_layer(layer_idx):
        return names + [f"mlp.{p}" for p in mlp]
    names += [f"mlp.gate.{p}" for p in ("weight", "e_score_correction_bias")]
    names += [f"mlp.experts.{e}.{p}" for e in range(moe.num_experts) for p in mlp]
    if moe.num_shared_experts:
        names += [f"mlp.shared_experts.{p}" for p in mlp]
    return names
