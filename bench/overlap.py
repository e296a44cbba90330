"""Async scheduling (engine/runner/overlap.py) against synchronous steps, and what a thread can hide on a CPU.

1. The engine on the zoo target (greedy, held-out-style token prompts), without speculation and with MTP
   k=3, at each batch size, async_scheduling off and on, alternating (best of --repeats): tokens/s,
   wall ms per step, the share of steps launched ahead, and the host's time per step outside the
   model runner's run/launch/collect in the synchronous engine (the most that overlap can hide). On a
   GPU the difference between the two wall times is the host time hidden; on a CPU torch runs the step
   on the calling thread, so the order changes and nothing is hidden.
2. CPU only, the reason a worker thread does not help there: the wall time of the engine's model step
   alone and while a second Python thread runs host-like Python work (dict and list churn) at the same
   time. The eager forward is Python between its ops, each op releases and retakes the GIL, and the
   other thread holds it for up to the switch interval (5 ms by default) each time.

    python -m bench.overlap [--device cpu|cuda] [--batches 1,16] [--repeats 3] [--threads 1]
"""
from __future__ import annotations

import argparse
import os
import threading
import time

PROMPT_TOKENS, NEW_TOKENS = 64, 64


def _prompts(n: int, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def _engine(model: str, head: str | None, device: str, async_scheduling: bool, batch: int):
    from engine import LLM, SpecConfig

    spec = SpecConfig(method="mtp", k=3, draft=head) if head else None
    return LLM(model, device=device, speculative=spec, max_num_seqs=max(batch, 1), async_scheduling=async_scheduling,
               num_kv_blocks=batch * (-(-(PROMPT_TOKENS + NEW_TOKENS + 8) // 16) + 1) + 16)


def _timed_run(llm, prompts) -> dict:
    """Generate, timing the host's share: wall time outside the runner's run/launch/collect."""
    from engine import SamplingParams

    runner = llm.engine.runner
    inside = [0.0]
    originals = {name: getattr(runner, name) for name in ("run", "launch", "collect")}

    def wrap(fn):
        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                inside[0] += time.perf_counter() - t
        return timed

    for name, fn in originals.items():
        setattr(runner, name, wrap(fn))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    steps = [0]
    step = llm.engine.step

    def counted():
        steps[0] += 1
        return step()

    llm.engine.step = counted
    try:
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))  # warm-up
        if llm.engine.runner.device.type == "cuda":
            import torch

            torch.cuda.synchronize()
        steps[0], inside[0] = 0, 0.0
        overlapped0 = llm.engine.num_overlapped_steps
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
    finally:
        for name in originals:
            delattr(runner, name)
        del llm.engine.step
    tokens = sum(len(o.token_ids) for o in outs)
    return {"tok_s": tokens / wall, "steps": steps[0], "wall_ms_per_step": 1000 * wall / steps[0],
            "host_ms_per_step": 1000 * (wall - inside[0]) / steps[0],
            "overlapped_share": (llm.engine.num_overlapped_steps - overlapped0) / steps[0]}


def gil_probe(model: str, head: str, steps: int = 8) -> dict:
    """Median wall ms of the runner's step alone and beside a busy Python thread (batch 1, MTP k=3)."""
    import statistics

    from engine import SamplingParams

    llm = _engine(model, head, "cpu", False, 1)
    runner = llm.engine.runner
    run = runner.run
    times = {"alone": [], "beside a Python thread": []}
    busy = threading.Event()

    def python_work():
        while busy.is_set():
            churn = {i: [i] * 4 for i in range(50)}
            sum(len(v) for v in churn.values())

    def measured(label):
        def timed(step):
            worker = None
            if label != "alone":
                busy.set()
                worker = threading.Thread(target=python_work)
                worker.start()
            t = time.perf_counter()
            try:
                return run(step)
            finally:
                times[label].append(1000 * (time.perf_counter() - t))
                if worker is not None:
                    busy.clear()
                    worker.join()
        return timed

    for label in times:
        runner.run = measured(label)
        llm.generate([[5, 17, 99, 123] * 8], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    del runner.run
    return {label: statistics.median(v[2:]) for label, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from bench.common import device_name, write_results
    from engine.config import ModelConfig
    import zoo

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    paths = zoo.layout(zoo.ensure_built())
    model, head = str(paths.target), str(paths.mtp)
    vocab = ModelConfig.from_dir(model).vocab_size
    load0 = os.getloadavg()[0]
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = _prompts(max(batch, 2 * batch), vocab)
        for mode, draft in (("none", None), ("mtp k=3", head)):
            best = {}
            for _ in range(args.repeats):
                for on in (False, True):
                    r = _timed_run(_engine(model, draft, args.device, on, batch), prompts)
                    if on not in best or r["tok_s"] > best[on]["tok_s"]:
                        best[on] = r
            rows.append({"batch": batch, "mode": mode, "sync": best[False], "async": best[True]})
            print(f"batch {batch} {mode}: sync {best[False]['tok_s']:.1f} tok/s, async {best[True]['tok_s']:.1f} "
                  f"tok/s ({best[True]['overlapped_share']:.0%} of steps ahead)", flush=True)
    probe = gil_probe(model, head) if args.device == "cpu" else None
    load1 = os.getloadavg()[0]

    lines = [f"# Async scheduling vs synchronous steps ({device_name(args.device)})", "",
             f"Zoo target `{os.path.basename(os.path.dirname(model))}`, greedy, {PROMPT_TOKENS}-token prompts, "
             f"{NEW_TOKENS} new tokens, 2 x batch requests at max_num_seqs = batch; off and on alternate, best of "
             f"{args.repeats}. Load average {load0:.1f} before, {load1:.1f} after.", "",
             "Host ms per step: wall time outside the model runner's run/launch/collect (scheduling, batch "
             "building, the update, detokenizing, outputs): what overlap can hide at most.", "",
             "Hidden ms per step: (sync wall - async wall) / sync steps; negative: async cost more (a request "
             "that ends at step N still ran in N+1, and steps that cannot be planned ahead wait for the one "
             "before).", "",
             "| batch | mode | sync tok/s | async tok/s | async / sync | sync steps | async steps "
             "| sync host ms/step | hidden ms/step | steps ahead |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        s, a = r["sync"], r["async"]
        hidden = (s["steps"] * s["wall_ms_per_step"] - a["steps"] * a["wall_ms_per_step"]) / s["steps"]
        lines.append(f"| {r['batch']} | {r['mode']} | {s['tok_s']:.1f} | {a['tok_s']:.1f} | {a['tok_s'] / s['tok_s']:.2f}x "
                     f"| {s['steps']} | {a['steps']} | {s['host_ms_per_step']:.2f} | {hidden:.2f} "
                     f"| {a['overlapped_share']:.0%} |")
    if probe is not None:
        alone, beside = probe["alone"], probe["beside a Python thread"]
        lines += ["", "Why a worker thread hides nothing on a CPU: median wall ms of the model step (batch 1, MTP "
                  "k=3) alone and while another Python thread of the same process runs Python work:", "",
                  "| step alone ms | beside a Python thread ms | slowdown |", "|---:|---:|---:|",
                  f"| {alone:.2f} | {beside:.2f} | {beside / alone:.0f}x |"]
    table = "\n".join(lines)
    path = write_results(f"overlap_{'gpu' if args.device == 'cuda' else 'cpu'}",
                         {"rows": rows, "gil_probe": probe, "load": [load0, load1]}, table)
    print(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
