"""HTTP serving benchmark: concurrency 1..64 against `tandem serve`'s application on this machine.

Reports per concurrency level: TTFT, time to the second token (which waits for the KV hand-over),
inter-token latency (TPOT and chunk gaps), output throughput, and the hand-over: its time, its share
of TTFT, and its bandwidth against the raw bandwidth of the same kind of channel measured in the same
run (two ChannelProbe actors moving the same payload sizes). Fixed seed, fixed prompts.

    python -m bench.serve                      # zoo target if built, else a random bench-size Llama
    python -m bench.serve --model DIR --levels 1,4,16,64 --max-tokens 64
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import uuid

import httpx


def _pct(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


async def _one(http: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    stamps, tokens = [], 0
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter() - start)
    return {"stamps": stamps, "tokens": tokens, "e2e": time.perf_counter() - start}


async def _level(base_url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int) -> dict:
    from bench.common import closed_loop

    results, wall = await closed_loop(base_url, prompts, concurrency,
                                      lambda http, prompt: _one(http, model, prompt, max_tokens))
    ttft = [r["stamps"][0] for r in results if r["stamps"]]
    tt2t = [r["stamps"][1] for r in results if len(r["stamps"]) > 1]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / max(1, r["tokens"] - 1) for r in results if len(r["stamps"]) > 1]
    gaps = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    tokens = sum(r["tokens"] for r in results)
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall, "output_tokens": tokens,
            "throughput_tok_s": tokens / wall, "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "tt2t_p50_s": _pct(tt2t, 0.5), "tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
            "chunk_gap_p99_s": _pct(gaps, 0.99)}


def _handover_stats(prefill_new: list, decode_new: list, tp: int) -> dict:
    """Sender side: (pack, answer wait, payload, bytes, dropped); receiver side: (receive s, unpack s, bytes)."""
    sent = [h for h in prefill_new if not h[4] and h[3] > 0]
    recv = [d for d in decode_new if d[2] > 0]
    total = [h[0] + h[1] + h[2] for h in sent]
    return {
        "handovers": len(sent),
        "handover_bytes_p50": _pct([h[3] for h in sent], 0.5),
        "handover_pack_p50_s": _pct([h[0] for h in sent], 0.5),
        "handover_answer_wait_p50_s": _pct([h[1] for h in sent], 0.5),
        "handover_payload_p50_s": _pct([h[2] for h in sent], 0.5),
        "handover_total_p50_s": _pct(total, 0.5),
        "handover_send_gbps": (sum(h[3] for h in sent) / max(1e-9, sum(h[2] for h in sent))) / 1e9 if sent else 0.0,
        # Per rank: each rank receives its slice (bytes / tp) while the others receive theirs.
        "handover_recv_gbps": (sum(d[2] / tp for d in recv) / max(1e-9, sum(d[0] for d in recv))) / 1e9
        if recv else 0.0,
        "handover_unpack_p50_s": _pct([d[1] for d in recv], 0.5),
    }


def _raw_channel_bandwidth(sizes: list[int], repeats: int = 20) -> dict[int, float]:
    """Same channel kind, two fresh actors, payloads of the hand-overs' sizes: bytes / payload seconds."""
    import ray

    from cluster.probe import ChannelProbe

    tx, rx = ChannelProbe.remote(), ChannelProbe.remote()
    cid = uuid.uuid4().hex[:10]
    addr = ray.get(rx.address.remote())
    accepted = rx.accept.remote(cid)
    ray.get(tx.connect.remote(addr, cid))
    ray.get(accepted)
    ray.get(tx.send_bytes.remote(cid, 1 << 20, 3))  # warm-up
    out = {}
    for size in sizes:
        ray.get(tx.send_bytes.remote(cid, int(size), repeats))
        deadline = time.monotonic() + 30
        while len(hist := [h for h in ray.get(rx.transfer_history.remote(cid)) if h[0] == size]) < repeats:
            assert time.monotonic() < deadline, "the probe receiver fell behind"
            time.sleep(0.05)
        out[int(size)] = size / statistics.median(s for _, s in hist[-repeats:]) / 1e9  # receive side
    ray.get(tx.close.remote(cid))
    for a in (tx, rx):
        ray.kill(a)
    return out


def _default_model(tmp: str) -> str:
    import zoo

    root = zoo.built_path()
    if root is not None:
        return str(zoo.layout(root).target)
    from cluster.testing import build_tiny_llama

    # Random weights: serving speed does not depend on them; the shape sets the KV bytes per token.
    return build_tiny_llama(f"{tmp}/bench-llama", hidden=256, layers=6, heads=4, num_kv_heads=4,
                            vocab=512, max_positions=1024)


def _plots(levels: list[dict], raw: dict[int, float], out_prefix) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(c, [lv["ttft_p50_s"] * 1e3 for lv in levels], "o-", label="TTFT p50")
    axes[0].plot(c, [lv["tt2t_p50_s"] * 1e3 for lv in levels], "s-", label="time to 2nd token p50")
    axes[0].plot(c, [lv["handover_total_p50_s"] * 1e3 for lv in levels], "^-", label="hand-over p50")
    axes[0].set(xscale="log", xlabel="concurrency", ylabel="ms", title="latency to first tokens")
    axes[1].plot(c, [lv["tpot_p50_s"] * 1e3 for lv in levels], "o-", label="TPOT p50")
    axes[1].plot(c, [lv["tpot_p99_s"] * 1e3 for lv in levels], "s-", label="TPOT p99")
    ax2 = axes[1].twinx()
    ax2.plot(c, [lv["throughput_tok_s"] for lv in levels], "k^--", label="throughput")
    ax2.set_ylabel("output tokens/s")
    axes[1].set(xscale="log", xlabel="concurrency", ylabel="ms/token", title="inter-token latency, throughput")
    sizes = sorted(raw)
    axes[2].plot(sizes, [raw[s] for s in sizes], "o-", label="raw channel")
    axes[2].plot([lv["handover_bytes_p50"] / lv["tp"] for lv in levels], [lv["handover_recv_gbps"] for lv in levels], "s",
                 label="hand-over payload per rank (receiver)")
    axes[2].set(xscale="log", xlabel="payload bytes", ylabel="GB/s", title="channel bandwidth")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = f"{out_prefix}.png"
    fig.savefig(path, dpi=110)
    return [path]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.serve", description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the zoo target if built, else a random Llama)")
    ap.add_argument("--levels", default="1,2,4,8,16,32,64")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-level", type=int, default=0, help="default: max(8, 2 x concurrency)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--name", default="serve_cpu")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from ray import serve

    from bench.common import RESULTS, device_name, write_results
    from cluster.rendezvous import free_port_on
    from cluster.runtime import RayOptions, init_ray
    from deploy.app import build_app
    from deploy.config import TandemConfig

    tmp = tempfile.mkdtemp(prefix="tandem-bench-")
    model_dir = args.model or _default_model(tmp)
    levels = [int(x) for x in args.levels.split(",")]
    max_c = max(levels)
    blocks = max_c * (-(-(args.prompt_tokens + args.max_tokens) // 16) + 1) + 64
    cfg = TandemConfig(model=model_dir, served_model_name="bench", tp=args.tp, device=args.device,
                       num_kv_blocks=blocks, max_num_seqs=max(64, max_c), max_inflight=4 * max_c + 16)
    init_ray(RayOptions(num_cpus=8, temp_dir=f"{tmp}/ray"))
    port = free_port_on("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name="tandem", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    prefill = serve.get_deployment_handle("prefill", app_name="tandem")
    decode = serve.get_deployment_handle("decode", app_name="tandem")

    rng = random.Random(args.seed)
    vocab = prefill.model_info.remote().result().vocab_size
    asyncio.run(_level(base, "bench", [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)]] * 4, 2,
                       args.max_tokens))  # warm-up: channels opened, first steps run
    # The raw channel at the hand-over's per-rank size, before and after the sweep (this box is shared).
    kv_bytes = prefill.handover_timings.remote(4).result()
    size0 = int(statistics.median([h[3] for h in kv_bytes]) // args.tp) if kv_bytes else 1 << 20
    raw_before = _raw_channel_bandwidth([size0])[size0]
    rows = []
    for c in levels:
        n = args.requests_per_level or max(8, 2 * c)
        prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(n)]
        p0, d0 = prefill.stats.remote().result()["handovers_total"], decode.stats.remote().result()["handovers_total"]
        row = asyncio.run(_level(base, "bench", prompts, c, args.max_tokens))
        p1, d1 = prefill.stats.remote().result()["handovers_total"], decode.stats.remote().result()["handovers_total"]
        row |= _handover_stats(prefill.handover_timings.remote(p1 - p0).result() if p1 > p0 else [],
                               decode.handover_timings.remote(d1 - d0).result() if d1 > d0 else [], args.tp)
        row["tp"] = args.tp
        row["handover_share_of_ttft"] = row["handover_total_p50_s"] / row["ttft_p50_s"]
        rows.append(row)
        print(f"c={c:3d} ttft {row['ttft_p50_s'] * 1e3:7.1f} ms  tt2t {row['tt2t_p50_s'] * 1e3:7.1f} ms  "
              f"tpot {row['tpot_p50_s'] * 1e3:6.1f} ms  {row['throughput_tok_s']:7.1f} tok/s  hand-over "
              f"{row['handover_total_p50_s'] * 1e3:6.2f} ms ({row['handover_share_of_ttft']:.0%} of TTFT, answer wait "
              f"{row['handover_answer_wait_p50_s'] * 1e3:.1f} ms), {row['handover_recv_gbps']:.3f} GB/s per rank",
              flush=True)

    kv_sizes = sorted({int(r["handover_bytes_p50"] // args.tp) for r in rows if r["handovers"]})
    per_rank = kv_sizes[len(kv_sizes) // 2] if kv_sizes else 0
    raw = _raw_channel_bandwidth(kv_sizes + [1 << 20, 16 << 20, 64 << 20])
    raw_at_kv = (raw.get(per_rank, float("nan")) + raw_before) / 2 if per_rank else float("nan")
    serve.shutdown()

    lines = [f"# Serving benchmark ({args.device}, tp={args.tp})", "",
             f"model `{model_dir}`; {args.prompt_tokens}-token prompts, {args.max_tokens} output tokens, greedy; "
             f"{device_name(args.device)}", "",
             "| conc | reqs | TTFT p50 ms | TTFT p99 ms | 2nd token p50 ms | TPOT p50 ms | TPOT p99 ms | tok/s | "
             "hand-over p50 ms | of TTFT | unpack p50 ms | recv GB/s per rank | vs raw channel |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['ttft_p50_s'] * 1e3:.1f} | {r['ttft_p99_s'] * 1e3:.1f} | "
                     f"{r['tt2t_p50_s'] * 1e3:.1f} | {r['tpot_p50_s'] * 1e3:.1f} | {r['tpot_p99_s'] * 1e3:.1f} | "
                     f"{r['throughput_tok_s']:.0f} | {r['handover_total_p50_s'] * 1e3:.2f} | "
                     f"{r['handover_share_of_ttft']:.0%} | {r['handover_unpack_p50_s'] * 1e3:.2f} | "
                     f"{r['handover_recv_gbps']:.3f} | {r['handover_recv_gbps'] / raw_at_kv:.0%} |")
    lines += ["", "Raw channel (ChannelProbe pair, same backend, same run, after the sweep): " +
              ", ".join(f"{s / 2**20:.2f} MiB: {g:.3f} GB/s" for s, g in sorted(raw.items())) +
              f"; before the sweep at {size0 / 2**20:.2f} MiB: {raw_before:.3f} GB/s.", "",
              "TTFT is measured to the first streamed token, which the prefill returns before the hand-over; "
              "the hand-over (pack + headers/answers + payload to every rank) sits on the path to the second "
              "token. 'of TTFT' is hand-over p50 / TTFT p50. Bandwidths are receive-side (recv posted -> payload "
              "in the buffer; the unpack into the blocks is separate) and per rank, compared with the raw channel "
              f"at the per-rank hand-over size ({per_rank / 2**20:.2f} MiB), mean of before and after the sweep."]
    table = "\n".join(lines)
    path = write_results(args.name, {"model": model_dir, "tp": args.tp, "device": args.device,
                                     "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                                     "levels": rows, "raw_channel_gbps": {str(k): v for k, v in raw.items()},
                                     "raw_channel_before_gbps": {str(size0): raw_before}}, table)
    _plots(rows, raw, RESULTS / args.name)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
