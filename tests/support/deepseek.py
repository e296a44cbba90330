"""Small random DeepSeek-V3 checkpoints saved by transformers (deterministic), with the tiny tokenizer: MLA
with YaRN, a dense first layer, then MoE layers with group-limited routing and a shared expert."""
from __future__ import annotations

import torch

from tests.support.tiny import VOCAB, tiny_tokenizer

# Two variants: q through a low-rank projection (DeepSeek-V3) with mscale = mscale_all_dim (the rotary table's
# attention factor is 1), and one q_proj (q_lora_rank null, as DeepSeek-V2-Lite) with mscale != mscale_all_dim.
VARIANTS = {
    "q_lora": dict(q_lora_rank=48, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1, "rope_theta": 10000.0}),
    "no_q_lora": dict(q_lora_rank=None, rope_parameters={
        "rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 0.8, "rope_theta": 50000.0}),
}


def deepseek_config(variant: str = "q_lora", **overrides):
    from transformers import DeepseekV3Config

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, qk_rope_head_dim=8,
                  v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=3,
                  first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=512,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    fields.update(VARIANTS[variant])
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def make_deepseek_checkpoint(path, variant: str = "q_lora", seed: int = 0, dtype=torch.float32, max_shard_size=None,
                             **overrides):
    """Save a random DeepSeek-V3 model and the tiny tokenizer in `path`; returns the transformers model."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(deepseek_config(variant, **overrides)).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # larger weights: well-separated greedy choices
                p.mul_(4.0)
        for name, b in model.named_buffers():
            # transformers starts the routing correction at zero; a trained model's is not
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand(b.shape) * 0.5)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tiny_tokenizer(path)
    return model


def add_mtp_layer(path, hf, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a random MTP layer (`model.layers.{N}.*`, N = num_hidden_layers, DeepSeek-V3's layout: enorm,
    hnorm, eh_proj, a MoE decoder block with per-expert weights, shared_head, its own copy of the embedding)
    beside the checkpoint in `path` as a second safetensors file; returns its tensors by name. transformers
    builds no MTP module, so tests check it against a plain-torch reference of its formula."""
    from safetensors.torch import save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = hf.config
    n = cfg.num_hidden_layers
    g = torch.Generator().manual_seed(seed)
    block = DeepseekV3DecoderLayer(cfg, layer_idx=n)
    tensors = {}
    for name, p in list(block.named_parameters()) + list(block.named_buffers()):
        if "norm" in name:
            value = 1 + 0.1 * torch.randn(p.shape, generator=g)
        elif name.endswith("e_score_correction_bias"):
            value = torch.rand(p.shape, generator=g) * 0.5
        else:
            value = torch.randn(p.shape, generator=g) * 0.08
        tensors[name] = value
    inter = cfg.moe_intermediate_size
    gate_up, down = tensors.pop("mlp.experts.gate_up_proj"), tensors.pop("mlp.experts.down_proj")
    for e in range(cfg.n_routed_experts):  # checkpoints hold experts one by one
        tensors[f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :inter]
        tensors[f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, inter:]
        tensors[f"mlp.experts.{e}.down_proj.weight"] = down[e]
    h = cfg.hidden_size
    tensors["enorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors["hnorm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors["eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.08
    tensors["shared_head.norm.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    tensors["embed_tokens.weight"] = hf.model.embed_tokens.weight.detach().clone()
    tensors["shared_head.head.weight"] = hf.lm_head.weight.detach().clone()
    named = {f"model.layers.{n}.{k}": v.to(hf.dtype).contiguous() for k, v in tensors.items()}
    save_file(named, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    return named


def mtp_logits_over_prompt(engine, prompt: list[int]) -> torch.Tensor:
    """[n - 1, V] the engine's MTP head over a prompt in one eager pass (the first draft step at every prompt
    position: the target's hidden state at i with token i + 1), writing the head's KV after the target's."""
    from engine import SamplingParams
    from engine.core.request import Request
    from engine.core.scheduler import ScheduledRequest
    from engine.layers.attention import attention_context
    from engine.runner.batch import build_batch

    head, n = engine.runner.proposer.head, len(prompt)
    req = Request("r", prompt, SamplingParams(), seed=0, max_total_tokens=engine.max_model_len)
    assert engine.blocks.allocate("r", n - 1)
    batch = build_batch([ScheduledRequest(req, n - 1, sample=False)], engine.blocks, engine.kv_cache,
                        engine.runner.device, engine.model_cfg.vocab_size, 0, None)
    with torch.inference_mode(), attention_context(batch.attn):
        hidden, _ = engine.runner.model(batch.input_ids, batch.positions)
        return head.compute_logits(head(hidden, torch.tensor(prompt[1:]), batch.positions))
