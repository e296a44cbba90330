"""The Llama family (Llama incl. Llama-3 RoPE scaling, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Our own modules: fused QKV and gate/up projections (column parallel), row-parallel output and down
projections, paged attention. The forward takes a flattened varlen batch ([T] tokens of any mix of
prefill chunks, decode tokens and verification chains) and has no host syncs or data-dependent shapes.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.distributed.data_parallel import DPContext
from engine.distributed.parallel import TPContext
from engine.errors import UnsupportedModelError
from engine.layers.attention import PagedAttention
from engine.layers.kv_spec import KVCacheSpec
from engine.layers.linear import Embedding, LMHead, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RopeAt, RotaryEmbedding
from kernels.activation import silu_and_mul


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPContext, rotary: RotaryEmbedding):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads,
                                          cfg.qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.o_bias, tp)
        self.head_dim = cfg.head_dim
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(layer_idx, self.qkv_proj.local_heads, self.qkv_proj.local_kv_heads, cfg.head_dim)

    def forward(self, rope: RopeAt, x: torch.Tensor) -> torch.Tensor:
        """rope: the forward's positions (RotaryEmbedding.at); x [T, H] -> [T, H]."""
        return self.o_proj(self.attend(rope, *self.project(rope, x)))

    def attend(self, rope: RopeAt, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The paged attention over `project`'s outputs, which it norms (Qwen3) and rotates first where they came
        un-normed and unrotated."""
        if not rope.fused:
            return self.attn(q, k, v)
        qk_norm = None if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        return self.attn(q, k, v, rope, qk_norm)

    def project(self, rope: RopeAt, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before the paged attention: x [T, H] -> q [T, Hq, D], k and v [T, Hkv, D], q and k normed
        (Qwen3) and rotated unless `rope.fused` (then `attend` does both in one launch with the KV store)."""
        T = x.shape[0]
        q, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q = q.view(T, -1, self.head_dim)
        k = k.view(T, -1, self.head_dim)
        v = v.view(T, -1, self.head_dim)
        if not rope.fused:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(rope, q, k)
        return q, k, v


class LlamaMLP(nn.Module):
    """Tensor-parallel over `tp`; with `dp` (attention data parallelism) over the whole DP group, on the
    rows of every rank: this rank's rows are exchanged around its shard (DPContext.mlp)."""

    def __init__(self, cfg: ModelConfig, tp: TPContext, dp: DPContext | None = None):
        super().__init__()
        if cfg.hidden_act != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg.hidden_act!r}; only 'silu' is implemented")
        self.dp = dp
        if dp is not None:
            tp = dp.mlp_tp
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [cfg.intermediate_size] * 2, cfg.mlp_bias, tp)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, tp,
                                           reduce=dp is None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp is not None:
            return self.dp.mlp(x, self._shard)
        return self._shard(x)

    def _shard(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPContext, rotary: RotaryEmbedding,
                 dp: DPContext | None = None):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, tp, rotary)
        self.mlp = LlamaMLP(cfg, tp, dp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, rope: RopeAt, hidden, residual):
        """Pre-norm block on the residual stream; returns (block output, residual) unsummed."""
        q, k, v, residual = self.attention_inputs(rope, hidden, residual)
        return self.finish(self.self_attn.attend(rope, q, k, v), residual)

    # The block around its paged attention, in two halves: a piecewise-compiled forward
    # (engine/models/piecewise.py) compiles each half with its neighbour and runs the attention between.
    def attention_inputs(self, rope: RopeAt, hidden, residual):
        """-> (q, k, v, residual): the input norm (adding the previous block's output to the residual
        stream, which the result carries) and the attention's projections."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return (*self.self_attn.project(rope, hidden), residual)

    def finish(self, attn: torch.Tensor, residual: torch.Tensor):
        """attn [T, Hq * D], the attention's output -> (block output, residual), unsummed."""
        hidden, residual = self.post_attention_layernorm(self.self_attn.o_proj(attn), residual)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, shard id)
    FUSED = {
        ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
        ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
    }

    piecewise = None  # PiecewiseForward (engine/models/piecewise.py) when EngineConfig.cpu_compile is "layers"
    decoder_layer = LlamaDecoderLayer  # a family that differs only in its blocks (Qwen3-MoE) swaps this

    def __init__(self, cfg: ModelConfig, tp: TPContext, dtype: torch.dtype, max_pos: int,
                 dp: DPContext | None = None):
        """tp: how attention heads are sharded (size 1 under attention data parallelism); dp: the ADP
        group the MLPs are sharded over and exchange rows with (engine/distributed/data_parallel.py)."""
        super().__init__()
        self.cfg = cfg
        self.dp = dp
        self.rotary = RotaryEmbedding(cfg.head_dim, max_pos, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.decoder_layer(cfg, i, tp, self.rotary, dp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def kv_cache_spec(self) -> KVCacheSpec:
        """K and V planes of this rank's KV heads (engine/layers/kv_spec.py)."""
        attn = self.layers[0].self_attn.attn
        return KVCacheSpec(planes=2, heads=attn.num_kv_heads, head_dim=attn.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                capture_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """input_ids, positions [T] -> (final normed hidden [T, H], hidden states after each layer in
        `capture_layers` (what draft heads read), in that order)."""
        if self.piecewise is not None:
            done = self.piecewise.run((input_ids,), positions)
            if done is not None:
                (final, last), residuals = done
                residuals.append(last)
                return final, [r for i, r in enumerate(residuals) if i in capture_layers]
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
        """ADP: this rank has no rows in a step where others do. Its MLP shards still serve their rows,
        layer by layer, with the same collectives (inside dp_rows); attention has nothing to attend."""
        assert self.dp is not None
        empty = torch.empty(0, self.cfg.hidden_size, dtype=dtype, device=device)
        for layer in self.layers:
            layer.mlp(empty)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] in fp32."""
        return self.lm_head(hidden).float()

    def param_for(self, ckpt_name: str) -> tuple[nn.Module, str, int | None] | None:
        """Map a checkpoint tensor name to (module that loads it, param name, shard id); None to skip."""
        name = ckpt_name
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None
        shard = None
        for frag, (fused, sid) in self.FUSED.items():
            if frag in name:
                name, shard = name.replace(frag, fused), sid
                break
        module_path, _, leaf = name.rpartition(".")
        try:
            module = self.get_submodule(module_path)
        except AttributeError:
            return None
        if not hasattr(module, leaf) or getattr(module, leaf) is None:
            return None
        return module, leaf, shard

    def expected_checkpoint_names(self) -> set[str]:
        """Every tensor name a complete checkpoint of this config must carry."""
        names = {"model.embed_tokens.weight", "model.norm.weight"}
        if not self.cfg.tie_word_embeddings:
            names.add("lm_head.weight")
        per_layer = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                     "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                     "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"]
        if self.cfg.qkv_bias:
            per_layer += ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
        if self.cfg.o_bias:
            per_layer.append("self_attn.o_proj.bias")
        if self.cfg.mlp_bias:
            per_layer += ["mlp.gate_proj.bias", "mlp.up_proj.bias", "mlp.down_proj.bias"]
        if self.cfg.qk_norm:
            per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        for i in range(self.cfg.num_layers):
            names.update(f"model.layers.{i}.{p}" for p in per_layer)
        return names
