"""Few-row CPU matmuls: MKL (F.linear, in the layout the engine keeps) against packed GEMMs
(engine/layers/packed_gemm.py), on weights read from memory.

For each weight shape (the zoo target's, bench/engine.py's random Llama's, a 1B Llama's) up to 12 copies
are cycled, so that from 16 MB a weight every call reads its weight from DRAM, as a decode step does (the
zoo's small weights stay in the last-level cache, as the whole zoo target does in a decode step). Rows 1
(plain decode), 4 (batch-1 verification with k=3), 8 and 16 (each row count's own kernel). Reports us per
matmul and the weight GB/s, best of --repeats passes over the copies, and the machine's copy bandwidth
(read + write, every core) beside it. Writes bench/results/packed_gemm_cpu.{json,md}.

    python -m bench.packed_gemm [--threads 1] [--repeats 5]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F

from bench.common import device_name, write_results

# (name, out, in): the widest and narrowest matmuls of three models
SHAPES = [
    ("zoo lm head", 4096, 192), ("zoo gate/up", 1024, 192),
    ("bench qkv", 1024, 512), ("bench gate/up", 2816, 512), ("bench down", 512, 1408), ("bench lm head", 8192, 512),
    ("1B o", 2048, 2048), ("1B gate/up", 11264, 2048), ("1B down", 2048, 5632),
]
ROWS = (1, 4, 8, 16)  # 16: past the engine's buckets, measured to show why
WORKING_SET = 192 << 20  # bytes of weight copies cycled per shape: well past a 32 MB L3


def _time(fn, xs, weights, repeats: int) -> float:
    """Best time per call over `repeats` passes, each calling fn once per weight copy."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for w in weights:
            fn(xs, w)
        best = min(best, (time.perf_counter() - start) / len(weights))
    return best


def bench_shape(out: int, inp: int, repeats: int) -> list[dict]:
    from engine.layers.packed_gemm import PackedGemm

    nbytes = out * inp * 4
    copies = min(12, max(2, WORKING_SET // nbytes))  # each compiles its own kernel: the zoo's stay cached
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inp, generator=gen) * 0.02 for _ in range(copies)]
    # the engine's layout (engine/layers/linear.py, matvec_layout): wide weights column-major
    engine_w = [w.t().contiguous().t() for w in weights] if out > inp else weights
    packed = [PackedGemm(w, None, "bench") for w in weights]
    runs = []
    with torch.inference_mode():
        for rows in ROWS:
            x = torch.randn(rows, inp, generator=gen)
            kernels = [p.compile(rows) for p in packed]
            assert all(k is not None for k in kernels), "a packed kernel did not compile"
            torch.testing.assert_close(kernels[0](x), F.linear(x, weights[0]), rtol=1e-3, atol=1e-3)
            mkl = _time(lambda x, w: F.linear(x, w), x, engine_w, repeats)
            mine = _time(lambda x, k: k(x), x, kernels, repeats)
            runs.append({"rows": rows, "mkl_us": mkl * 1e6, "packed_us": mine * 1e6, "mkl_GBs": nbytes / mkl / 1e9,
                         "packed_GBs": nbytes / mine / 1e9, "speedup": mkl / mine})
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--name", default="packed_gemm_cpu")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from bench.engine import host_memory_bandwidth_gbs

    results = {"device": device_name("cpu"), "threads": args.threads, "load_before": os.getloadavg(), "shapes": []}
    rows = []
    for name, out, inp in SHAPES:
        runs = bench_shape(out, inp, args.repeats)
        results["shapes"].append({"name": name, "out": out, "in": inp, "runs": runs})
        for r in runs:
            rows.append(f"| {name} | {out}x{inp} | {r['rows']} | {r['mkl_us']:.1f} | {r['packed_us']:.1f} | "
                        f"{r['mkl_GBs']:.1f} | {r['packed_GBs']:.1f} | {r['speedup']:.2f}x |")
            print(rows[-1], flush=True)
    torch.set_num_threads(os.cpu_count())
    results["copy_GBs_all_cores"] = host_memory_bandwidth_gbs()
    torch.set_num_threads(args.threads)
    results["copy_GBs_threads"] = host_memory_bandwidth_gbs()
    table = "\n".join([
        f"# Few-row CPU matmuls: MKL against packed GEMMs ({results['device']})",
        f"fp32 weights cycled through up to 12 copies per shape ({WORKING_SET >> 20} MB at most: from DRAM at "
        f"16 MB a weight and up, the zoo's stay in cache); "
        f"MKL on the engine's layout (wide weights column-major); best of {args.repeats} passes. Copy bandwidth "
        f"(read + write): {results['copy_GBs_all_cores']:.1f} GB/s on every core, {results['copy_GBs_threads']:.1f} "
        f"GB/s on {args.threads} thread(s). Load average before {results['load_before'][0]:.2f}, after "
        f"{os.getloadavg()[0]:.2f}.",
        "", "| weight | shape | rows | MKL us | packed us | MKL GB/s | packed GB/s | speedup |",
        "|---|---|---|---|---|---|---|---|", *rows])
    print(write_results(args.name, results, table).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
