"""Kernel benchmarks: achieved bandwidth against the machine's limit, Triton against the torch reference.

Sizes are those of serving an 8B Llama (32 query / 8 KV heads of 128, hidden 4096, vocab 128256,
16-token KV blocks) plus, for attention, the tiny zoo model that the engine runs on CPU. On CUDA each
kernel is timed as Triton, torch reference and (bitmask) xgrammar's own kernel; on CPU only the
reference path runs (it is what the engine uses there). "Bytes" is the memory the operation must
touch at least; GB/s = bytes / median time; "% limit" compares with a device-to-device copy measured
in the same run (the practical bandwidth ceiling).

    python -m bench.kernels [--device cpu|cuda] [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from bench.common import device_name, write_results
from kernels import attention, bitmask, kv_transfer, norm_rope, store_kv, verify


@dataclass(frozen=True, slots=True)
class Result:
    kernel: str
    case: str
    impl: str
    median_ms: float
    min_ms: float
    bytes: int
    gbps: float
    pct_limit: float
    vs_ref: float  # reference median / this median


def _time(fn, device: str, iters: int) -> tuple[float, float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times), min(times)


def copy_bandwidth(device: str) -> float:
    """GB/s of a large tensor copy (read + write), the practical memory limit."""
    n = (1 << 28) if device == "cuda" else (1 << 24)
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    med, _ = _time(lambda: dst.copy_(src), device, 10)
    return 2 * n * 4 / med / 1e6


# ------------------------------------------------------------------------------------------ cases


def attention_cases(device, dtype, quick):
    shapes = [("tiny 6/2x64", 6, 2, 64, [(1, 500), (16, 500)])]
    big = device == "cuda" and not quick  # CPU: the 8B shapes at sizes a CPU serves
    shapes.append(("8B 32/8x128", 32, 8, 128, [(1, 4096), (1, 32768), (16, 2048), (64, 4096)] if big else
                   [(1, 4096), (16, 2048)]))
    for name, Hq, Hkv, D, batches in shapes:
        for B, L in batches:
            S = 16
            nb = L // S
            N = B * nb + 1
            kv = torch.randn(2, N, S, Hkv, D, dtype=dtype, device=device)
            bt = torch.randperm(N, device=device)[: B * nb].view(B, nb).int()
            args = (torch.randn(B, Hq, D, dtype=dtype, device=device), kv[0], kv[1], bt,
                    torch.full((B,), L, dtype=torch.int32, device=device),
                    torch.arange(B + 1, dtype=torch.int32, device=device), D**-0.5, 1, L)
            nbytes = 2 * B * L * Hkv * D * kv.element_size()
            impls = {"ref": lambda a=args: attention.paged_attention_ref(*a)}
            if device == "cuda":
                impls["triton"] = lambda a=args: attention.paged_attention_triton(*a)
            yield "paged_attention decode", f"{name} B={B} L={L}", nbytes, impls
    # prefill: one 2048-token prompt of the 8B shape
    T, Hq, Hkv, D, S = (2048 if device == "cuda" and not quick else 512), 32, 8, 128, 16
    kv = torch.randn(2, T // S, S, Hkv, D, dtype=dtype, device=device)
    args = (torch.randn(T, Hq, D, dtype=dtype, device=device), kv[0], kv[1],
            torch.arange(T // S, dtype=torch.int32, device=device)[None],
            torch.tensor([T], dtype=torch.int32, device=device),
            torch.tensor([0, T], dtype=torch.int32, device=device), D**-0.5, T, T)
    impls = {"ref": lambda: attention.paged_attention_ref(*args)}
    if device == "cuda":
        impls["triton"] = lambda: attention.paged_attention_triton(*args)
    yield "paged_attention prefill", f"8B T={T}", 2 * T * (Hq + Hkv) * D * kv.element_size(), impls


def store_kv_cases(device, dtype, quick):
    T, Hkv, D, N, S = 256, 8, 128, 4096, 16
    kv = torch.zeros(2, N, S, Hkv, D, dtype=dtype, device=device)
    key, value = torch.randn(2, T, Hkv, D, dtype=dtype, device=device)
    slots = torch.randperm(N * S, device=device)[:T]
    args = (key, value, kv[0], kv[1], slots)
    impls = {"ref": lambda: store_kv.store_kv_ref(*args)}
    if device == "cuda":
        impls["triton"] = lambda: store_kv.store_kv_triton(*args)
    yield "store_kv", f"T={T} 8x128", 4 * T * Hkv * D * kv.element_size(), impls


def bitmask_cases(device, dtype, quick):
    import xgrammar as xgr

    V = 128256
    for rows in (16, 128):
        logits = torch.randn(rows, V, dtype=torch.float32, device=device)
        words = torch.randint(-(2**31), 2**31 - 1, (rows, (V + 31) // 32), dtype=torch.int32, device=device)
        flag = torch.ones(rows, dtype=torch.bool, device=device)
        impls = {"ref": lambda lg=logits, w=words, f=flag: bitmask.apply_token_bitmask_ref(lg, w, f),
                 "xgrammar": lambda lg=logits, w=words: xgr.apply_token_bitmask_inplace(lg, w)}
        if device == "cuda":
            impls["triton"] = lambda lg=logits, w=words, f=flag: bitmask.apply_token_bitmask_triton(lg, w, f)
        # half the tokens are banned: their logits are written; the words are read
        yield "token bitmask", f"rows={rows} V={V}", rows * V * 4 // 2 + words.numel() * 4, impls


def verify_cases(device, dtype, quick):
    V, k = 128256, 4
    for B in (1, 16) if quick else (1, 16, 64):
        g = torch.Generator(device=device).manual_seed(B)
        logits = torch.randn(B, k + 1, V, generator=g, device=device, dtype=dtype)
        drafts = torch.randint(0, V, (B, k), generator=g, device=device)
        nbytes = logits.numel() * logits.element_size()
        impls = {"ref": lambda lg=logits, d=drafts: verify.verify_greedy_ref(lg, d)}
        if device == "cuda":
            impls["triton"] = lambda lg=logits, d=drafts: verify.verify_greedy_triton(lg, d)
        yield "verify_greedy", f"B={B} k={k} V={V}", nbytes, impls
        args = (logits, drafts, None, torch.full((B,), 0.8, device=device), torch.zeros(B, dtype=torch.int32, device=device),
                torch.ones(B, device=device), torch.arange(B, device=device), torch.full((B,), 100, device=device))
        impls = {"ref": lambda a=args: verify.verify_rejection_ref(*a, has_filters=False)}
        if device == "cuda":
            impls["triton"] = lambda a=args: verify.verify_rejection_triton(*a, has_filters=False)
        yield "verify_rejection", f"B={B} k={k} V={V} no top-k/p", nbytes, impls


def kv_transfer_cases(device, dtype, quick):
    L, N, S, H, D, n = 32, 1024, 16, 8, 128, (32 if quick else 128)
    kv = torch.randn(L, 2, N, S, H, D, dtype=dtype, device=device)
    ids = torch.randperm(N, device=device)[:n]
    buf = kv_transfer.pack_kv_ref(kv, ids)
    nbytes = 2 * buf.numel() * buf.element_size()
    for name, fn in (("pack_kv", "pack"), ("unpack_kv", "unpack")):
        if fn == "pack":
            impls = {"ref": lambda: kv_transfer.pack_kv_ref(kv, ids, buf)}
            if device == "cuda":
                impls["triton"] = lambda: kv_transfer.pack_kv_triton(kv, ids, buf)
        else:
            impls = {"ref": lambda: kv_transfer.unpack_kv_ref(buf, kv, ids)}
            if device == "cuda":
                impls["triton"] = lambda: kv_transfer.unpack_kv_triton(buf, kv, ids)
        yield name, f"8B {n} blocks (L={L})", nbytes, impls


def norm_rope_cases(device, dtype, quick):
    T, H = 256, 4096
    x, res = torch.randn(2, T, H, dtype=dtype, device=device)
    w = torch.randn(H, dtype=dtype, device=device)
    impls = {"ref": lambda: norm_rope.rms_norm_ref(x, w, 1e-5, res)}
    if device == "cuda":
        impls["triton"] = lambda: norm_rope.rms_norm_triton(x, w, 1e-5, res)
    yield "rms_norm+residual", f"T={T} H={H}", 4 * T * H * x.element_size(), impls
    q = torch.randn(T, 32, 128, dtype=dtype, device=device)
    k = torch.randn(T, 8, 128, dtype=dtype, device=device)
    pos = torch.randint(0, 8192, (T,), device=device)
    cache = norm_rope.build_rope_cache(128, 8192, 500000.0, None, torch.float32, device)
    impls = {"ref": lambda: norm_rope.apply_rope_ref(q, k, pos, cache)}
    if device == "cuda":
        impls["triton"] = lambda: norm_rope.apply_rope_triton(q, k, pos, cache)
    yield "rope", f"T={T} 32+8 heads x128", 2 * (q.numel() + k.numel()) * q.element_size(), impls


# ------------------------------------------------------------------------------------------- main


def run(device: str, quick: bool) -> tuple[list[Result], float]:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    limit = copy_bandwidth(device)
    iters = 20 if device == "cuda" else 7
    results = []
    for cases in (attention_cases, store_kv_cases, bitmask_cases, verify_cases, kv_transfer_cases, norm_rope_cases):
        for kernel, case, nbytes, impls in cases(device, dtype, quick):
            timed = {impl: _time(fn, device, iters) for impl, fn in impls.items()}
            ref_med = timed["ref"][0]
            for impl, (med, best) in timed.items():
                gbps = nbytes / med / 1e6
                results.append(Result(kernel, case, impl, round(med, 4), round(best, 4), nbytes, round(gbps, 2),
                                      round(100 * gbps / limit, 1), round(ref_med / med, 2)))
    return results, limit


def table(results: list[Result], device: str, limit: float, load: float) -> str:
    lines = [f"# bench/kernels.py on {device_name(device)}",
             f"Measured copy bandwidth (the limit): {limit:.1f} GB/s. Median of repeated runs; "
             "vs ref = reference median / this median. Bytes: see the module docstring.",
             f"1-minute load average at start: {load:.1f} on {os.cpu_count()} cores "
             "(other work on a shared machine inflates medians; min ms is the cleaner number).", "",
             "| kernel | case | impl | median ms | min ms | GB/s | % limit | vs ref |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.kernel} | {r.case} | {r.impl} | {r.median_ms:.3f} | {r.min_ms:.3f} | {r.gbps:.1f} | "
                     f"{r.pct_limit:.1f} | {r.vs_ref:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="fewer and smaller cases")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    load = os.getloadavg()[0]
    results, limit = run(args.device, args.quick)
    text = table(results, args.device, limit, load)
    write_results(f"kernels_{args.device}", {"device": device_name(args.device), "copy_gbps": limit, "load": load,
                                             "results": [asdict(r) for r in results]}, text)
    print(text)


if __name__ == "__main__":
    main()
