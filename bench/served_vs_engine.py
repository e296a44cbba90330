"""The served path against the engine it wraps, in one run: output tokens/s through HTTP (router ->
prefill -> hand-over -> decode group) and through the in-process engine, same model, same MTP head, same
prompts, same closed-loop concurrency.

Deployments: `tandem serve`'s embedded default (the zoo target, MTP k=3) with decode tp=2 and with tp=1.
The engine runs first, in this process, with one torch thread (as each served actor has; the served
deployment gets the same cores, spread over its processes), `max_num_seqs` = the concurrency, all requests submitted at once (the
engine's scheduler then keeps `concurrency` running, as the HTTP clients do). Greedy, `ignore_eos`.

    python -m bench.served_vs_engine [--levels 1,16,64] [--tps 2,1] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.served_vs_engine", description=__doc__.splitlines()[0])
    ap.add_argument("--levels", default="1,16,64")
    ap.add_argument("--tps", default="2,1", help="decode tp of each served deployment")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--engine-threads", type=int, default=1, help="torch threads of the in-process engine (1: as "
                    "each served actor; more oversubscribes a small shared machine)")
    ap.add_argument("--name", default="served_vs_engine_cpu")
    args = ap.parse_args(argv)

    import torch
    from ray import serve

    import zoo
    from bench.common import device_name, write_results
    from cluster.rendezvous import free_port_on
    from cluster.runtime import RayOptions, init_ray
    from deploy.app import build_app
    from deploy.config import TandemConfig
    from engine.config import ModelConfig

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
        engine_rows[c] = _engine_level(model, head, blocks, prompts[c], c, args.max_tokens)
        print(f"engine c={c}: {engine_rows[c]['throughput_tok_s']:.1f} tok/s", flush=True)

    tmp = tempfile.mkdtemp(prefix="tandem-bench-")
    init_ray(RayOptions(num_cpus=8, temp_dir=f"{tmp}/ray"))
    port = free_port_on("127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    served: dict[int, dict[int, dict]] = {}
    for tp in [int(t) for t in args.tps.split(",")]:
        name = f"tp{tp}"
        cfg = TandemConfig(model=model, served_model_name=name, tp=tp, speculative_method="mtp", draft=head,
                           num_speculative_tokens=3, num_kv_blocks=blocks, max_num_seqs=max(64, max(levels)),
                           max_inflight=4 * max(levels) + 16)
        serve.run(build_app(cfg), name=name, route_prefix=f"/{name}")
        base = f"http://127.0.0.1:{port}/{name}"
        asyncio.run(_level(base, name, prompts[levels[0]][:4], 2, 8))  # warm-up
        served[tp] = {}
        for c in levels:
            served[tp][c] = asyncio.run(_level(base, name, prompts[c], c, args.max_tokens))
            print(f"served tp={tp} c={c}: {served[tp][c]['throughput_tok_s']:.1f} tok/s", flush=True)
        serve.delete(name)
    serve.shutdown()
    import ray

    ray.shutdown()

    tps = list(served)
    lines = [f"# Served path vs in-process engine ({device_name('cpu')})", "",
             f"Zoo target + MTP head (k=3), {args.prompt_tokens}-token random prompts, {args.max_tokens} output "
             "tokens, greedy, closed loop at each concurrency (2 x concurrency requests, at least 8). Engine: "
             f"{args.engine_threads} torch thread(s), run first; load average at the start {load_start:.1f}.", "",
             "| concurrency | engine tok/s | " + " | ".join(f"served tp={tp} tok/s | tp={tp} / engine" for tp in tps) + " |",
             "|---:|---:|" + "---:|---:|" * len(tps)]
    for c in levels:
        e = engine_rows[c]["throughput_tok_s"]
        cells = " | ".join(f"{served[tp][c]['throughput_tok_s']:.0f} | {served[tp][c]['throughput_tok_s'] / e:.2f}x"
                           for tp in tps)
        lines.append(f"| {c} | {e:.0f} | {cells} |")
    table = "\n".join(lines)
    path = write_results(args.name, {"model": model, "draft": head, "levels": levels, "engine": engine_rows,
                                     "served": {str(tp): rows for tp, rows in served.items()}}, table)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
