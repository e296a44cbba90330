"""KV cache footprint: bytes per token and the most concurrent requests a fixed KV budget holds, MLA against a GQA
model of similar size, and how tensor parallelism and attention data parallelism change it.

The models are the engine's own, built on the meta device from published configs (no weights): each states its
per-layer cache shape (`kv_cache_spec()`, engine/layers/kv_spec.py), which is what the model runner allocates.
DeepSeek-V3 (671B, MLA: one latent row of kv_lora_rank + qk_rope_head_dim per token per layer) against
Llama-3.1-405B (GQA: 8 KV heads of 128, K and V), both bf16. Under tp=2 GQA heads shard (each rank holds half a
token's KV) while MLA's latent is replicated (each rank holds all of it); under dp=2 each rank holds whole tokens
of its own requests. Arithmetic, not a timing: the numbers are exact.

    python -m bench.kv_footprint [--budget-gib 40] [--context 4096]
"""
from __future__ import annotations

import argparse

import torch

from bench.common import write_results
from engine.config import ModelConfig
from engine.distributed.parallel import TPContext
from engine.models.registry import build_model


def published() -> dict[str, ModelConfig]:
    from transformers import DeepseekV3Config, LlamaConfig

    llama = LlamaConfig(vocab_size=128256, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                        num_attention_heads=128, num_key_value_heads=8, max_position_embeddings=131072)
    return {"DeepSeek-V3 (MLA)": ModelConfig.from_hf(DeepseekV3Config(), "DeepseekV3ForCausalLM"),
            "Llama-3.1-405B (GQA 8)": ModelConfig.from_hf(llama, "LlamaForCausalLM")}


def spec_of(cfg: ModelConfig, tp_size: int):
    """The per-layer cache spec of rank 0 of `tp_size` ranks (no collective runs: the group is never used)."""
    tp = TPContext(0, tp_size, group=object()) if tp_size > 1 else TPContext()
    with torch.device("meta"):
        return build_model(cfg, tp, torch.bfloat16, max_pos=16).kv_cache_spec()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV cache memory per rank")
    ap.add_argument("--context", type=int, default=4096, help="tokens per request")
    args = ap.parse_args()
    budget = int(args.budget_gib * 2**30)
    rows = []
    for name, cfg in published().items():
        for layout, tp_size, ranks in (("1 rank", 1, 1), ("tp=2", 2, 2), ("dp=2", 1, 2)):
            spec = spec_of(cfg, tp_size)
            per_token = cfg.num_layers * spec.bytes_per_token(torch.bfloat16)  # on each rank holding the token
            # tp: every rank holds (its share of) every request's tokens; dp: each rank its own requests
            requests = budget // (per_token * args.context) * (ranks if layout == "dp=2" else 1)
            rows.append(dict(model=name, layout=layout, spec=f"{spec.planes}x{spec.heads}x{spec.head_dim}",
                             elements_per_token_layer=spec.elements_per_token(), bytes_per_token_rank=per_token,
                             max_requests=requests))
    lines = [f"# KV footprint, bf16, {args.budget_gib:g} GiB of KV per rank, {args.context}-token requests", "",
             "| model | layout | per-layer cache (planes x heads x dim) | elements / token / layer | "
             "bytes / token on a rank | max concurrent requests |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['layout']} | {r['spec']} | {r['elements_per_token_layer']} | "
              f"{r['bytes_per_token_rank']} | {r['max_requests']} |" for r in rows]
    table = "\n".join(lines)
    print(table)
    write_results("kv_footprint", {"budget_gib": args.budget_gib, "context": args.context, "rows": rows}, table)


if __name__ == "__main__":
    main()
