"""The C++ CPU paged attention (kernels/cpu/paged_attention.cpp) against the torch reference it replaces for short
requests: one layer's K/V stores plus attention, per call, at SmolLM2-135M's heads (9 query heads, 3 KV heads,
head dim 64) and 16-token pages in random order, alternating the two in each round; median of rounds.

    python -m bench.cpu_attention [--rounds 7] [--calls 100] [--threads 2]

Warm: the same layer's cache every call (in a decode step the weights streamed between two layers evict it, so the
engine's per-call time is higher; bench/real_model.py decode measures the step). Writes
bench/results/cpu_attention_cpu.{json,md}.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import device_name, write_results
from kernels import cpu_ext
from kernels.attention import paged_attention_cpu, paged_attention_ref, plan_paged_attention
from kernels.store_kv import plan_store_kv, store_kv

# (requests, context length, rows per request): decode at batch 1 / 16 / 64, verification chains (k = 3, 7),
# a 16-node tree's rows, and prefill-sized chunks where the reference takes over.
SHAPES = [(1, 130, 1), (1, 700, 1), (16, 300, 1), (64, 300, 1), (1, 130, 4), (4, 200, 4), (1, 130, 8),
          (1, 300, 16), (1, 300, 64)]


def case(B: int, seq: int, mq: int, gen: torch.Generator, S: int = 16, Hkv: int = 3, G: int = 3, D: int = 64):
    M = -(-seq // S)
    N = B * M + 8
    kc, vc = torch.randn(N, S, Hkv, D, generator=gen), torch.randn(N, S, Hkv, D, generator=gen)
    tables = torch.randperm(N, generator=gen)[: B * M].view(B, M).int()
    T = B * mq
    pos = torch.arange(T) % mq + seq - mq  # each request's new rows are its last mq positions
    slots = tables.long().repeat_interleave(mq, 0).gather(1, (pos // S)[:, None])[:, 0] * S + pos % S
    return dict(q=torch.randn(T, Hkv * G, D, generator=gen), k=torch.randn(T, Hkv, D, generator=gen),
                v=torch.randn(T, Hkv, D, generator=gen), kc=kc, vc=vc, tables=tables, slots=slots,
                seq=torch.full((B,), seq, dtype=torch.int32), qsl=torch.arange(0, T + 1, mq, dtype=torch.int32),
                mq=mq, max_seq=seq, G=G, S=S)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not cpu_ext.available():
        raise SystemExit(f"the C++ CPU kernels are off: {cpu_ext.why_off()}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for B, seq, mq in SHAPES:
        c = case(B, seq, mq, gen)
        scale = 0.125
        out = torch.empty_like(c["q"])

        def reference():  # the engine's reference path: plans made once per step, shared by its layers
            store_kv(c["k"], c["v"], c["kc"], c["vc"], c["slots"], store_plan)
            return paged_attention_ref(c["q"], c["kc"], c["vc"], c["tables"], c["seq"], c["qsl"], scale, c["mq"],
                                       c["max_seq"], plan=plan)

        def kernel():
            return paged_attention_cpu(c["q"], c["kc"], c["vc"], c["tables"], c["seq"], c["qsl"], scale, out=out,
                                       key=c["k"], value=c["v"], slot_mapping=c["slots"])

        store_plan = plan_store_kv(c["slots"])
        plan = plan_paged_attention(c["tables"], c["seq"], c["qsl"], c["q"].shape[0], c["S"], c["G"], c["mq"],
                                    c["max_seq"])
        err = float((kernel() - reference()).abs().max())
        times = {"reference": [], "kernel": []}
        for _ in range(args.rounds):
            for name, fn in (("reference", reference), ("kernel", kernel)):
                for _ in range(5):
                    fn()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fn()
                times[name].append((time.perf_counter() - start) / args.calls * 1e6)
        ref_us, ker_us = statistics.median(times["reference"]), statistics.median(times["kernel"])
        row = {"requests": B, "context": seq, "rows_per_request": mq, "reference_us": round(ref_us, 1),
               "kernel_us": round(ker_us, 1), "speedup": round(ref_us / ker_us, 2), "max_abs_diff": err}
        rows.append(row)
        print(row, flush=True)
    table = ["| requests | context | rows/request | reference us | C++ kernel us | speedup |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['requests']} | {r['context']} | {r['rows_per_request']} | {r['reference_us']} | "
              f"{r['kernel_us']} | {r['speedup']}x |" for r in rows]
    payload = {"device": device_name("cpu"), "threads": args.threads, "heads": "9 query / 3 KV, head dim 64",
               "runs": rows}
    print(write_results("cpu_attention_cpu", payload, "\n".join(table)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
