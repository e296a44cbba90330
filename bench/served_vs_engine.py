"""The served path against the engine it wraps, in one run: output tokens/s through HTTP (router ->
prefill -> hand-over -> decode group) and through the in-process engine, same model, same MTP head, same
prompts, same closed-loop concurrency.

Deployments: `tandem serve`'s embedded default (the zoo target, MTP k=3, direct ingress) with decode tp=2
and with tp=1, and optionally other values of `steps_in_flight`, `handover_stock`, the ingress, the
router's `feed_link` and the ranks' `tp_shm` (one deployment per combination; the defaults are the
deployment's own).
The engine runs before and after them, in this process, with one torch thread (as each served actor has;
the served deployment gets the same cores, spread over its processes), `max_num_seqs` = the concurrency,
all requests submitted at once (the engine's scheduler then keeps `concurrency` running, as the HTTP
clients do). Greedy, `ignore_eos`. Per served run it also records where the time and CPU went: group
steps, tokens per step, the ranks' busy share, and CPU seconds per process role (bench/proc_cpu.py).

Every measurement is taken `--repeats` times (the engine's before and after the served deployments, each
served level back to back) and the ratio is the median served run over the median engine run: on a small
shared machine one run of a few seconds varies by +-10%, as much as the effects measured here.

    python -m bench.served_vs_engine [--levels 1,16,64] [--tps 2,1] [--max-tokens 64] [--repeats 3]
                                     [--steps-in-flight 1,2] [--handover-stock 0,0.125] [--ingress direct,proxy]
                                     [--feed-link on,off] [--tp-shm on,off] [--cpu-compile off,layers]

The in-process engine runs eagerly; `--cpu-compile` compiles the served decode ranks (EngineConfig.cpu_compile).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time

from bench import proc_cpu
from bench.serve import _level


def _engine_level(model: str, head: str, blocks: int, prompts: list[list[int]], concurrency: int,
                  max_tokens: int) -> dict:
    """The engine with `concurrency` running at most (its scheduler keeps that many going, as the clients do)."""
    from engine import LLM, SamplingParams, SpecConfig

    llm = LLM(model, num_kv_blocks=blocks, max_num_seqs=concurrency, speculative=SpecConfig(method="mtp", k=3,
                                                                                           draft=head))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"concurrency": concurrency, "requests": len(prompts), "wall_s": wall, "output_tokens": tokens,
            "throughput_tok_s": tokens / wall}


def _decode_default(name: str):
    from decode_worker.config import DecodeConfig

    return DecodeConfig.model_fields[name].default


def _router_default(name: str):
    from router.config import RouterSettings

    return RouterSettings.model_fields[name].default


def _serve_parser():
    from deploy.serve_cmd import parser

    return parser()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.served_vs_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--tps", default="2,1", help="decode tp of each served deployment")
    # The defaults are the deployment's own (DecodeConfig): a figure for "the default deployment" must not
    # quietly measure another one (session 9's re-run took stock 0 here while `tandem serve` uses 0.125).
    ap.add_argument("--steps-in-flight", default=str(_decode_default("steps_in_flight")),
                    help="the decode replica's steps_in_flight, one deployment per value (e.g. 1,2 to compare strict "
                    "lockstep with a step queued ahead); default: the deployment's")
    ap.add_argument("--handover-stock", default=f'{_decode_default("handover_stock"):g}',
                    help="the decode ranks' handover_stock, one deployment per value (e.g. 0,0.125); default: the "
                    "deployment's")
    ap.add_argument("--ingress", default=_serve_parser().get_default("ingress"),
                    help="how HTTP reaches the router, one deployment per value: direct (the router replica answers "
                    "on its own port) and/or proxy (Serve's HTTP proxy relays every chunk), e.g. direct,proxy; "
                    "default: tandem serve's")
    ap.add_argument("--feed-link", default="on" if _router_default("feed_link") else "off",
                    help="how decode tokens reach the router, one deployment per value: on (feed links, "
                    "cluster/feed_link.py) and/or off (Serve streams), e.g. on,off; default: the router's")
    ap.add_argument("--tp-shm", default="on" if _decode_default("tp_shm") else "off",
                    help="how tp>1 ranks make their collectives, one deployment per value: on (shared memory, "
                    "engine/distributed/shm_collectives.py) and/or off (gloo), e.g. on,off; default: the deployment's")
    ap.add_argument("--cpu-compile", default="off", help="the decode ranks' cpu_compile: off, gemm, layers "
                                                          "(comma-separated: one deployment each)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each measurement (the median counts)")
    ap.add_argument("--engine-threads", type=int, default=1, help="torch threads of the in-process engine (1: as "
                    "each served actor; more oversubscribes a small shared machine)")
    ap.add_argument("--name", default="served_vs_engine_cpu")
    args = ap.parse_args(argv)

    import torch
    from ray import serve

    from bench.common import device_name, write_results
    from cluster.rendezvous import free_port_on
    from cluster.runtime import RayOptions, init_ray
    from deploy.app import application
    from deploy.config import TandemConfig
    from engine.config import ModelConfig
    import zoo

    paths = zoo.layout(zoo.build())
    model, head = str(paths.target), str(paths.mtp)
    levels = [int(x) for x in args.levels.split(",")]
    rng = random.Random(args.seed)
    vocab = ModelConfig.from_dir(model).vocab_size
    prompts = {c: [[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)] for _ in range(max(8, 2 * c))]
               for c in levels}
    blocks = max(levels) * (-(-(args.prompt_tokens + args.max_tokens + 8) // 16) + 1) + 64

    load_start = __import__("os").getloadavg()[0]
    torch.set_num_threads(args.engine_threads)
    engine_rows = {}
    for c in levels:
        runs = []
        for _ in range(args.repeats):
            cpu0 = time.process_time()
            runs.append(_engine_level(model, head, blocks, prompts[c], c, args.max_tokens))
            runs[-1]["cpu_s"] = time.process_time() - cpu0
        engine_rows[c] = _median_run(runs)
        print(f"engine c={c}: {_spread(runs)} tok/s", flush=True)

    tmp = tempfile.mkdtemp(prefix="tandem-bench-")
    init_ray(RayOptions(num_cpus=8, temp_dir=f"{tmp}/ray"))
    ingresses = args.ingress.split(",")
    port = free_port_on("127.0.0.1")
    # No proxy runs unless a deployment uses it, as under `tandem serve` with direct ingress.
    serve.start(proxy_location=None if "proxy" in ingresses else "Disabled",
                http_options={"host": "127.0.0.1", "port": port})
    served: dict[str, dict[int, dict]] = {}
    in_flights, stocks = args.steps_in_flight.split(","), args.handover_stock.split(",")
    feeds, shms, compiles = args.feed_link.split(","), args.tp_shm.split(","), args.cpu_compile.split(",")
    variants = [(int(tp), int(n), float(st), ing, fl, sh, cc) for tp in args.tps.split(",") for n in in_flights
                for st in stocks for ing in ingresses for fl in feeds for sh in shms for cc in compiles]
    for tp, in_flight, stock, ingress, feed, shm, compile_mode in variants:
        label = (f"tp={tp}" + (f", {in_flight} in flight" if len(in_flights) > 1 else "")
                 + (f", stock {stock:g}" if len(stocks) > 1 else "") + (f", {ingress}" if len(ingresses) > 1 else "")
                 + (f", feed link {feed}" if len(feeds) > 1 else "") + (f", tp shm {shm}" if len(shms) > 1 else "")
                 + (f", cpu_compile {compile_mode}" if len(compiles) > 1 or compile_mode != "off" else ""))
        name = f"tp{tp}x{in_flight}s{int(stock * 1000)}{ingress}{feed}{shm}{compile_mode}"
        cfg = TandemConfig(model=model, served_model_name=name, tp=tp, speculative_method="mtp", draft=head,
                           num_speculative_tokens=3, num_kv_blocks=blocks, max_num_seqs=max(64, max(levels)),
                           max_inflight=4 * max(levels) + 16, steps_in_flight=in_flight, handover_stock=stock,
                           feed_link=feed == "on", tp_shm=shm == "on", cpu_compile=compile_mode)
        api = ("127.0.0.1", free_port_on("127.0.0.1")) if ingress == "direct" else None
        serve.run(application(cfg, api), name=name, route_prefix=f"/{name}")
        decode = serve.get_deployment_handle("decode", app_name=name)
        base = f"http://127.0.0.1:{api[1]}" if api else f"http://127.0.0.1:{port}/{name}"
        asyncio.run(_level(base, name, prompts[levels[0]][:4], 2, 8))  # warm-up
        served[label] = {}
        for c in levels:
            runs = []
            for _ in range(args.repeats):
                before, d0 = proc_cpu.snapshot(), decode.stats.remote().result()
                runs.append(row := asyncio.run(_level(base, name, prompts[c], c, args.max_tokens)))
                row["cpu_s_by_role"] = proc_cpu.used(before, proc_cpu.snapshot())
                d1 = decode.stats.remote().result()
                # The decode group's own view: how many group steps, and how busy its ranks were in them.
                row["decode_steps"] = d1["steps"] - d0["steps"]
                row["rank_busy_share"] = (d1["rank_step_seconds"] - d0["rank_step_seconds"]) / row["wall_s"]
                row["tokens_per_step"] = row["output_tokens"] / max(1, row["decode_steps"])
            served[label][c] = row = _median_run(runs)
            print(f"served {label} c={c}: {_spread(runs)} tok/s; median run: {row['decode_steps']} steps, "
                  f"{row['tokens_per_step']:.1f} tok/step, ranks busy {row['rank_busy_share']:.0%}, "
                  f"TTFT p50 {row['ttft_p50_s']:.3f} s, 2nd token p50 {row['tt2t_p50_s']:.3f} s, "
                  f"TPOT p50 {row['tpot_p50_s']:.3f} s; CPU s by role: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in row["cpu_s_by_role"].items()), flush=True)
        serve.delete(name)
    serve.shutdown()
    import ray

    ray.shutdown()
    # The engine again, after the served runs: the machine is shared, and a load change between the two
    # shows as a gap between the engine's two figures (the ratios use their mean).
    for c in levels:
        again = [_engine_level(model, head, blocks, prompts[c], c, args.max_tokens) for _ in range(args.repeats)]
        engine_rows[c]["after"] = _median_run(again)
        print(f"engine again c={c}: {_spread(again)} tok/s", flush=True)
    load_end = __import__("os").getloadavg()[0]

    labels = list(served)
    lines = [f"# Served path vs in-process engine ({device_name('cpu')})", "",
             f"Zoo target + MTP head (k=3), {args.prompt_tokens}-token random prompts, {args.max_tokens} output "
             "tokens, greedy, closed loop at each concurrency (2 x concurrency requests, at least 8). Engine: "
             f"{args.engine_threads} torch thread(s), run {args.repeats} times before and {args.repeats} times after "
             "the served deployments; each served level runs "
             f"{args.repeats} times. Tok/s: the median run (lowest-highest); the ratio is the served median over the "
             f"median of all the engine's runs. Load average {load_start:.1f} at the start, {load_end:.1f} at the end.",
             "", "| concurrency | engine tok/s (before; after) | "
             + " | ".join(f"{v} tok/s | / engine" for v in labels) + " |",
             "|---:|---:|" + "---:|---:|" * len(labels)]
    for c in levels:
        before, after = engine_rows[c], engine_rows[c]["after"]
        e = statistics.median(before["runs_tok_s"] + after["runs_tok_s"])
        cells = " | ".join(f"{_spread_of(served[v][c])} | {served[v][c]['throughput_tok_s'] / e:.2f}x" for v in labels)
        lines.append(f"| {c} | {_spread_of(before)}; {_spread_of(after)} | {cells} |")
    lines += ["", "Where the served run's time and CPU went (per deployment and concurrency): group steps, output "
              "tokens per step, the share of wall time the decode ranks spent inside steps, time to the first and "
              "second token, and CPU seconds per process role (from /proc; `bench` is this process: the HTTP "
              "clients).", "",
              "| deployment | conc | steps | tok/step | ranks busy | TTFT p50 s | 2nd token p50 s | CPU s by role |",
              "|---|---:|---:|---:|---:|---:|---:|---|"]
    for v in labels:
        for c in levels:
            r = served[v][c]
            cpu = ", ".join(f"{k} {x:.1f}" for k, x in r["cpu_s_by_role"].items() if x >= 0.1)
            lines.append(f"| {v} | {c} | {r['decode_steps']} | {r['tokens_per_step']:.1f} | {r['rank_busy_share']:.0%} "
                         f"| {r['ttft_p50_s']:.3f} | {r['tt2t_p50_s']:.3f} | {cpu} |")
    table = "\n".join(lines)
    path = write_results(args.name, {"model": model, "draft": head, "levels": levels, "engine": engine_rows,
                                     "served": served}, table)
    print(table)
    print(f"wrote {path}")
    return 0


def _median_run(runs: list[dict]) -> dict:
    """The run with the median tok/s (the lower middle one of an even count), with every run's tok/s."""
    ordered = sorted(runs, key=lambda r: r["throughput_tok_s"])
    return {**ordered[(len(ordered) - 1) // 2], "runs_tok_s": [r["throughput_tok_s"] for r in runs]}


def _spread(runs: list[dict]) -> str:
    return _spread_of(_median_run(runs))


def _spread_of(row: dict) -> str:
    """'median (lowest-highest)' of a median run's tok/s."""
    values = row["runs_tok_s"]
    if len(values) == 1:
        return f"{values[0]:.0f}"
    return f"{row['throughput_tok_s']:.0f} ({min(values):.0f}-{max(values):.0f})"


if __name__ == "__main__":
    raise SystemExit(main())
