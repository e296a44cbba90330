"""Builds a DeepSeek-V3-shaped zoo (a recipe with `moe`): tokenizer -> MLA + MoE target -> its own MTP layer.

Layout (what `zoo.layout` names; a MoE zoo has no draft/ and no eagle3/):
    tokenizer/  as every zoo
    target/     DeepseekV3ForCausalLM: config.json (num_nextn_predict_layers 1), model.safetensors (transformers
                loads it), mtp.safetensors (`model.layers.{N}.*`, the MTP layer, where DeepSeek-V3 keeps it),
                generation_config.json + the tokenizer files
    zoo.json    manifest: recipe, versions, parameter counts, losses, routing balance, build time, peak memory

The target trains on the same corpus and packing as the Llama zoos. Routing is balanced the way DeepSeek-V3
trains without an auxiliary loss: after each step every MoE layer's `e_score_correction_bias` moves by
`bias_update_speed` towards the experts that got fewer than their share of the step's (token, choice) pairs,
so the checkpoint carries a trained, non-zero correction bias (what transformers initializes at zero). The MTP
layer then distills from the frozen target through zoo.distill, `ttt_depth` steps deep.
"""
from __future__ import annotations

import json
import resource
import time
from pathlib import Path

import torch
from tqdm import tqdm

from zoo.cache import code_version, software_versions
from zoo.distill import distill
from zoo.heads.deepseek_mtp import DeepseekMTPLayer
from zoo.recipe import Recipe
from zoo.stages import DTYPES, prepare_data, save_hf_model, tail_mean, torch_threads, training_batches
from zoo.training import MAX_POSITIONS, ROPE_THETA, train_lm

PARTS = ("tokenizer", "target")


def deepseek_config(recipe: Recipe, vocab_size: int, special_ids: dict[str, int]):
    from transformers import DeepseekV3Config

    shape, moe = recipe.target, recipe.moe
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads, q_lora_rank=moe.q_lora_rank, kv_lora_rank=moe.kv_lora_rank,
        qk_nope_head_dim=moe.qk_nope_head_dim, qk_rope_head_dim=moe.qk_rope_head_dim, v_head_dim=moe.v_head_dim,
        n_routed_experts=moe.n_routed_experts, num_experts_per_tok=moe.num_experts_per_tok,
        n_shared_experts=moe.n_shared_experts, moe_intermediate_size=moe.moe_intermediate_size,
        first_k_dense_replace=moe.first_k_dense_replace, n_group=moe.n_group, topk_group=moe.topk_group,
        routed_scaling_factor=moe.routed_scaling_factor, norm_topk_prob=True, num_nextn_predict_layers=1,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5, initializer_range=0.02,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA}, tie_word_embeddings=False,
        bos_token_id=special_ids["bos"], eos_token_id=special_ids["eos"], pad_token_id=special_ids["pad"],
    )


def new_deepseek(recipe: Recipe, vocab_size: int, special_ids: dict[str, int], seed: int):
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    return DeepseekV3ForCausalLM(deepseek_config(recipe, vocab_size, special_ids)).float()


class RoutingBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3, section 2.1.2): counts each router's (token, choice) pairs per
    expert during a step; `update()` then moves every bias by `speed` up for experts under the mean load and
    down for those over it. `imbalance()`: the last step's max load / mean load, per router."""

    def __init__(self, modules: list[torch.nn.Module], speed: float):
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.routers = [m for module in modules for m in module.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.speed = speed
        self.loads = [torch.zeros(r.num_experts) for r in self.routers]
        self.last: list[float] = []
        self.hooks = [r.register_forward_hook(self._count(i)) for i, r in enumerate(self.routers)]

    def _count(self, index: int):
        def hook(router, args, output):
            topk_indices = output[2]  # [tokens, top_k]
            self.loads[index] += torch.bincount(topk_indices.flatten(), minlength=router.num_experts).float()
        return hook

    @torch.no_grad()
    def update(self) -> None:
        self.last = []
        for router, load in zip(self.routers, self.loads):
            if load.sum() == 0:
                continue
            router.e_score_correction_bias += self.speed * torch.sign(load.mean() - load)
            self.last.append(round(float(load.max() / load.mean()), 3))
            load.zero_()

    def close(self) -> None:
        for hook in self.hooks:
            hook.remove()


def build_moe_zoo(recipe: Recipe, out_dir: Path) -> dict:
    """Build the tokenizer, the target and its MTP layer into `out_dir`; -> the manifest (also zoo.json)."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stages = tqdm(total=4, desc=f"zoo[{recipe.name}]", unit="stage")
    with torch_threads(recipe.threads):
        stages.set_postfix_str("corpus + tokenizer")
        tokenizer, special, json_docs, prompt_lens, filler_docs = prepare_data(recipe, out_dir)
        vocab = tokenizer.get_vocab_size()
        stages.update()

        stages.set_postfix_str("target")
        sched = recipe.target_schedule
        docs = (json_docs, filler_docs, prompt_lens, special["pad"])
        ids, weight = training_batches(recipe, docs, sched, 1)
        target = new_deepseek(recipe, vocab, special, recipe.seed)
        balancer = RoutingBalancer([target], recipe.moe.bias_update_speed)
        target_losses = train_lm(target, ids, weight, sched, desc="target", after_step=balancer.update)
        balancer.close()
        stages.update()

        stages.set_postfix_str("mtp layer")
        mtp = DeepseekMTPLayer.from_target(target, torch.Generator().manual_seed(recipe.seed + 2))
        mtp_balancer = RoutingBalancer([mtp], recipe.moe.bias_update_speed)
        hs = recipe.heads_schedule
        ids, weight = training_batches(recipe, docs, hs, 4)
        head_losses = distill(target, {"mtp": mtp}, ids, weight, hs, recipe.ttt_depth, None,
                              after_step=mtp_balancer.update)
        mtp_balancer.close()
        stages.update()

        stages.set_postfix_str("save")
        save_hf_model(target, out_dir / "target", out_dir / "tokenizer", recipe.save_dtype)
        mtp.save_beside(out_dir / "target", DTYPES[recipe.save_dtype])
        stages.update()
    stages.close()
    manifest = {
        "recipe": recipe.to_dict(),
        "parts": {name: name for name in PARTS},
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "mtp_parameters": sum(p.numel() for n, p in mtp.named_parameters() if p.requires_grad),
        "losses": {"target_first": target_losses[0], "target_last": tail_mean(target_losses),
                   "mtp_last": tail_mean(head_losses["mtp"])},
        # max / mean (token, choice) pairs per expert over the last training step, per MoE layer
        "routing_imbalance": {"target": balancer.last, "mtp": mtp_balancer.last},
        "versions": software_versions(),
        "code_version": code_version()[:16],
        "build_seconds": round(time.perf_counter() - started, 1),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    }
    (out_dir / "zoo.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
