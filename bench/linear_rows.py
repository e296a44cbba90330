"""What a row costs in a few-row CPU decode step: the streamed C++ matmul (kernels/linear_rows.py, the engine's under
cpu_compile=full) over every projection of SmolLM2-135M's 30 layers (the LM head apart), at 1-16 rows, fp32, with
the same weights streamed in bf16 (EngineConfig.weight_dtype: fp32 arithmetic) and MKL's F.linear beside it.

At one row the step reads its weights once and is bound by memory bandwidth; every further row adds the arithmetic
of one more token against the same bytes. Where the CPU's FMA throughput is low (the 2-core Zen-1 EPYC these
results come from: one 256-bit FMA per cycle per core) that arithmetic is not hidden behind the reads, and a row's
marginal cost sets what a verified draft costs: it is the reason the row buckets of whole-forward graphs include 2
(engine/layers/streamed_gemm.py STREAMED_BUCKETS). Random weights of the model's shapes (the cost does not depend on
the values); rows alternate within each repeat; medians. Writes bench/results/<name>.{json,md}.

    python -m bench.linear_rows [--rows 1,2,3,4,8,16] [--repeats 7] [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from bench.common import device_name, write_results

# SmolLM2-135M: hidden 576, 9 query and 3 KV heads of 64, MLP 1536 (gate and up fused, as the engine keeps them)
LAYER = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
LAYERS = 30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.linear_rows", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="linear_rows_cpu")
    args = ap.parse_args(argv)
    from kernels import cpu_ext
    from kernels.linear_rows import linear_rows, pack_rows

    if not cpu_ext.available():
        raise SystemExit(f"the C++ CPU kernels are off here: {cpu_ext.why_off()}")
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = [(n, k) for _ in range(LAYERS) for _, n, k in LAYER]
    weights = [torch.randn(n, k) for n, k in shapes]
    packed = [pack_rows(w) for w in weights]
    # bf16 weights under fp32 arithmetic (EngineConfig.weight_dtype): half the bytes, widened in registers
    packed_bf16 = [pack_rows(w.to(torch.bfloat16)) for w in weights]
    gb = sum(n * k for n, k in shapes) * 4 / 1e9
    xs = {m: {k: torch.randn(m, k) for k in {k for _, k in shapes}} for m in rows}

    def streamed(m):
        for (n, k), p in zip(shapes, packed):
            linear_rows(xs[m][k], p, None, n)

    def streamed_bf16(m):
        for (n, k), p in zip(shapes, packed_bf16):
            linear_rows(xs[m][k], p, None, n)

    def mkl(m):
        for (_, k), w in zip(shapes, weights):
            F.linear(xs[m][k], w)

    times: dict[tuple[str, int], list[float]] = {}
    with torch.no_grad():
        for _ in range(args.repeats):
            for m in rows:
                for name, fn in (("streamed", streamed), ("bf16", streamed_bf16), ("mkl", mkl)):
                    start = time.perf_counter()
                    fn(m)
                    times.setdefault((name, m), []).append(time.perf_counter() - start)
    med = {key: sorted(v)[len(v) // 2] for key, v in times.items()}
    one = med[("streamed", rows[0])]
    runs = [{"rows": m, "streamed_ms": round(med[("streamed", m)] * 1e3, 2), "mkl_ms": round(med[("mkl", m)] * 1e3, 2),
             "vs_one_row": round(med[("streamed", m)] / one, 3),
             "weight_gb_s": round(gb / med[("streamed", m)], 1),
             "gflop_s": round(2 * m * gb / 4 * 1e9 / med[("streamed", m)] / 1e9, 1),
             "bf16_ms": round(med[("bf16", m)] * 1e3, 2), "bf16_vs_fp32": round(med[("streamed", m)] / med[("bf16", m)], 2),
             "bf16_weight_gb_s": round(gb / 2 / med[("bf16", m)], 1)} for m in rows]
    results = {"device": device_name("cpu"), "threads": args.threads, "repeats": args.repeats,
               "weight_gb": round(gb, 3), "runs": runs}
    table = ["| rows | streamed ms | vs 1 row | weight GB/s | GFLOP/s | bf16 weights ms | bf16 speedup | bf16 GB/s "
             "| MKL F.linear ms |", "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        table.append(f"| {r['rows']} | {r['streamed_ms']} | {r['vs_one_row']:.2f}x | {r['weight_gb_s']} | {r['gflop_s']} "
                     f"| {r['bf16_ms']} | {r['bf16_vs_fp32']:.2f}x | {r['bf16_weight_gb_s']} | {r['mkl_ms']} |")
    print(write_results(args.name, results, "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
