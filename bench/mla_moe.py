"""DeepSeek-V3-family kernels: latent paged attention (Triton against its torch reference) with achieved
bandwidth against a device-to-device copy measured in the same run, and the MoE experts' batched forms
(grouped GEMMs over sorted pairs; gathered weights) against a per-expert loop.

Attention sizes are DeepSeek-V3's (kv_lora_rank 512, qk_rope_head_dim 64; 128 heads on one rank, 16 under
tp 8); "bytes" is the latent cache the step must read (plus queries and outputs). With 128 heads every cached
byte feeds ~240 FLOPs (all heads read the same row), about an H200's ratio of bf16 matmul rate to bandwidth, so
that case is judged by TFLOP/s; with 16 heads it is bandwidth-bound. Expert sizes are
DeepSeek-V2-Lite's (64 experts of 1408, top 6, hidden 2048) so they fit any GPU; the per-expert loop is what
transformers runs (a host sync per step, so no graph).

    python -m bench.mla_moe [--device cuda|cpu] [--quick]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bench.common import device_name, write_results
from bench.kernels import _time, copy_bandwidth
from engine.distributed.parallel import TPContext
from engine.layers.moe import RoutedExperts
from kernels.mla_attention import mla_attention_ref, mla_attention_triton

L, R = 512, 64


def attention_rows(device: str, quick: bool, limit: float) -> list[dict]:
    rows = []
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    cases = [(128, 1, 1, 4096), (128, 16, 1, 4096), (128, 64, 1, 4096), (16, 64, 1, 4096), (128, 16, 4, 4096),
             (128, 64, 1, 16384)]
    for H, B, q_len, kv in cases[:3] if quick else cases:
        page = 16
        nb = -(-kv // page)
        cache = torch.randn(B * nb + 1, page, L + R, device=device, dtype=dtype)
        tables = torch.arange(B * nb, device=device, dtype=torch.int32).view(B, nb)
        seq = torch.full((B,), kv, device=device, dtype=torch.int32)
        qsl = torch.arange(0, B * q_len + 1, q_len, device=device, dtype=torch.int32)
        T = B * q_len
        q_lat = torch.randn(T, H, L, device=device, dtype=dtype)
        q_rope = torch.randn(T, H, R, device=device, dtype=dtype)
        args = (q_lat, q_rope, cache, tables, seq, qsl, 0.1, q_len, kv)
        nbytes = (B * kv * (L + R) + 2 * T * H * L + T * H * R) * dtype.itemsize
        # scores over L + R and the latent-space output over L, per head per cached position (q << kv)
        flops = 2 * T * H * kv * ((L + R) + L)
        impls = {"reference": lambda: mla_attention_ref(*args)}
        if device == "cuda":
            impls["triton"] = lambda: mla_attention_triton(*args)
        ref_ms = None
        for impl, fn in impls.items():
            med, low = _time(fn, device, 5 if quick else 20)
            ref_ms = med if impl == "reference" else ref_ms
            gbps = nbytes / med / 1e6
            rows.append(dict(kernel="mla_attention", case=f"H={H} B={B} q={q_len} kv={kv}", impl=impl,
                             median_ms=round(med, 4), gbps=round(gbps, 1), pct_limit=round(100 * gbps / limit, 1),
                             tflops=round(flops / med / 1e9, 1), vs_ref=round(ref_ms / med, 2)))
    return rows


def moe_rows(device: str, quick: bool) -> list[dict]:
    E, H, I, K = (64, 2048, 1408, 6) if device == "cuda" else (16, 256, 128, 4)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    experts = RoutedExperts(H, I, E, TPContext()).to(device)
    with torch.no_grad():
        experts.w13.normal_(0, 0.02)
        experts.w2.normal_(0, 0.02)
    experts = experts.to(dtype)
    rows = []
    for T in (1, 16, 256) if quick else (1, 16, 64, 256, 1024):
        x = torch.randn(T, H, device=device, dtype=dtype)
        ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)])
        w = torch.rand(T, K, device=device)

        def loop():  # one expert at a time over the tokens routed to it (transformers' form)
            out = torch.zeros_like(x)
            for e in ids.unique().tolist():
                tok, k = torch.where(ids == e)
                gate, up = F.linear(x[tok], experts.w13[e]).chunk(2, -1)
                y = F.linear(F.silu(gate) * up, experts.w2[e]) * w[tok, k, None].to(dtype)
                out.index_add_(0, tok, y)
            return out

        impls = {"per-expert loop": loop, "gathered": lambda: experts._gathered(x, w, ids)}
        if device == "cpu" or dtype == torch.bfloat16:
            impls["grouped"] = lambda: experts._grouped(x, w, ids)
        base = None
        for impl, fn in impls.items():
            med, _ = _time(fn, device, 5 if quick else 20)
            base = med if base is None else base
            rows.append(dict(kernel="moe_experts", case=f"E={E} H={H} I={I} top{K} T={T}", impl=impl,
                             median_ms=round(med, 4), vs_loop=round(base / med, 2)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    limit = copy_bandwidth(args.device)
    with torch.inference_mode():
        attn, moe = attention_rows(args.device, args.quick, limit), moe_rows(args.device, args.quick)
    lines = [f"# DeepSeek-V3 family kernels on {device_name(args.device)} (copy limit {limit:.0f} GB/s)", "",
             "| kernel | case | impl | median ms | GB/s | % limit | TFLOP/s | vs ref |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['case']} | {r['impl']} | {r['median_ms']} | {r['gbps']} | {r['pct_limit']} | "
              f"{r['tflops']} | {r['vs_ref']} |" for r in attn]
    lines += ["", "| kernel | case | impl | median ms | vs per-expert loop |", "|---|---|---|---|---|"]
    lines += [f"| {r['kernel']} | {r['case']} | {r['impl']} | {r['median_ms']} | {r['vs_loop']} |" for r in moe]
    table = "\n".join(lines)
    print(table)
    write_results(f"mla_moe_{args.device}", {"device": device_name(args.device), "copy_gbps": limit,
                                              "attention": attn, "moe": moe}, table)


if __name__ == "__main__":
    main()
