"""What one speculative step costs against a plain decode step, and where its time goes.

On the zoo target (greedy, held-out JSON prompts): the engine without speculation and with MTP k=3,
run alternately in the same process (best of --repeats, the CPU is shared). Per decode step (steps in
which every scheduled request already has its first token) the engine's own functions are timed:

- target forward: the Llama forward over the step's B*(k+1) rows (k = 0: B rows);
- lm head: logits at the verification rows;
- verify/sample: sampling (k = 0) or verification of the k+1 positions;
- draft: the head over all rows plus its k-step chain (drafts, sampling, chain metadata);
- host: everything else in LLMEngine.step (scheduling, the batch's tensors, the step's own small
  ops, the copy to the host, the update of the requests).

Everything runs eagerly on the CPU with one torch thread, so the time around a call is that call's
cost. The parts are timed in this thread's CPU time (time.thread_time): the machine is shared, and
CPU time leaves out the time the thread waited to be scheduled (wall-clock ms per step is reported
beside it). Also reports tokens/s (wall-clock) of each mode and the mean accepted length. Writes bench/results/spec_step_cpu.{json,md}.

    python -m bench.spec_step [--batches 1,64] [--repeats 3] [--threads 1] [--cpu-compile layers] [--token-map F]

--token-map adds MTP k=3 drafting from a hot vocabulary (SpecConfig.token_map), in the same run.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from bench.common import device_name, write_results

PARTS = ("target forward", "lm head", "verify/sample", "draft", "host")


class StepTimer:
    """Wraps an engine's step and its parts with wall-clock timers (instance attributes only: the
    engine's classes are untouched)."""

    def __init__(self, engine):
        import engine.runner.step as step_module

        self.engine = engine
        self.decode_steps = 0
        self.totals: dict[str, float] = defaultdict(float)
        self._current: dict[str, float] | None = None
        self._decode = False
        runner = engine.runner
        self._wrap(runner.model, "forward", "target forward")
        self._wrap(runner.model, "compute_logits", "lm head")
        if runner.proposer is not None:
            self._wrap(runner.proposer, "propose", "draft")
        self._step_module = step_module
        self._verify = step_module.verify
        step_module.verify = self._timed(self._verify, "verify/sample")
        prepare = runner.prepare

        def timed_prepare(scheduled, blocks, *args, **kw):
            self._decode = bool(scheduled) and all(s.request.num_output_tokens > 0 for s in scheduled)
            return prepare(scheduled, blocks, *args, **kw)

        runner.prepare = timed_prepare
        step = engine.step

        def timed_step():
            self._current, self._decode = defaultdict(float), False
            start, wall = time.thread_time(), time.perf_counter()
            out = step()
            total, wall = time.thread_time() - start, time.perf_counter() - wall
            if self._decode:
                self.decode_steps += 1
                self.totals["step"] += total
                self.totals["wall"] += wall
                for part, seconds in self._current.items():
                    self.totals[part] += seconds
            self._current = None
            return out

        engine.step = timed_step

    def close(self) -> None:
        self._step_module.verify = self._verify

    def _timed(self, fn, part: str):
        def timed(*a, **kw):
            start = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                if self._current is not None:
                    self._current[part] += time.thread_time() - start
        return timed

    def _wrap(self, obj, name: str, part: str) -> None:
        setattr(obj, name, self._timed(getattr(obj, name), part))

    def per_step_ms(self) -> dict[str, float]:
        n = max(self.decode_steps, 1)
        out = {p: self.totals[p] / n * 1e3 for p in PARTS if p != "host"}
        out["host"] = self.totals["step"] / n * 1e3 - sum(out.values())
        out["step"] = self.totals["step"] / n * 1e3
        out["wall"] = self.totals["wall"] / n * 1e3
        return out


@contextmanager
def timed_engine(llm):
    timer = StepTimer(llm.engine)
    try:
        yield timer
    finally:
        timer.close()


def run_once(llm, prompts: list[str], max_tokens: int) -> dict:
    from engine import SamplingParams

    eng = llm.engine
    eng.spec_stats.reset()
    with timed_engine(llm) as timer:
        start = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
        seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    spec = eng.stats().get("spec") or {}
    return {"tok_s": tokens / seconds, "tokens": tokens, "seconds": seconds, "decode_steps": timer.decode_steps,
            "per_step_ms": timer.per_step_ms(), "mean_accepted_length": spec.get("mean_accepted_length"),
            "outputs": [o.token_ids for o in outs]}


def bench(args) -> dict:
    from bench.spec import load_prompts
    from engine import LLM, SamplingParams, SpecConfig
    from engine.speculative.token_map import read_token_map
    import zoo

    paths = zoo.layout(zoo.ensure_built() if args.zoo is None else args.zoo)
    mtp = SpecConfig(method="mtp", k=3, draft=str(paths.mtp))
    modes = {"none": (None, "off"), "mtp k=3": (mtp, "off")}
    if args.token_map:
        vocab = json.loads((paths.target / "config.json").read_text())["vocab_size"]
        size = len(read_token_map(args.token_map, vocab))
        modes[f"mtp k=3 map {size}"] = (dataclasses.replace(mtp, token_map=args.token_map), "off")
    if args.cpu_compile != "off":  # the same two engines compiled (engine/layers/cpu_compile.py), in the same run
        modes.update({f"none [{args.cpu_compile}]": (None, args.cpu_compile),
                      f"mtp k=3 [{args.cpu_compile}]": (mtp, args.cpu_compile)})
    all_prompts = load_prompts(max(args.batches) * 2)["json"]
    results = {"zoo": str(paths.root), "device": device_name("cpu"), "threads": torch.get_num_threads(),
               "max_tokens": args.max_tokens, "repeats": args.repeats, "load_before": os.getloadavg(), "runs": []}
    for batch in args.batches:
        prompts = all_prompts[: max(2 * batch, args.prompts)]
        llms = {m: LLM(str(paths.target), max_num_seqs=batch, num_kv_blocks=max(256, batch * 96), block_size=16,
                       speculative=s, cpu_compile=c) for m, (s, c) in modes.items()}
        for llm in llms.values():
            llm.generate(prompts[:batch], SamplingParams(max_tokens=8, temperature=0))  # warm-up
        best = run_alternating(llms, prompts, args.max_tokens, args.repeats, lambda r: r["tok_s"])
        add_rows(results, batch, best, _base)
        del llms
    results["load_after"] = os.getloadavg()
    return results


def run_alternating(llms: dict, prompts: list, max_tokens: int, repeats: int, score) -> dict[str, dict]:
    """mode -> its best run_once of `repeats` (highest score(run)); the modes alternate, so that a burst of
    load on the shared machine hits them alike."""
    best: dict[str, dict] = {}
    for _ in range(repeats):
        for mode, llm in llms.items():
            r = run_once(llm, prompts, max_tokens)
            if mode not in best or score(r) > score(best[mode]):
                best[mode] = r
    return best


def add_rows(results: dict, batch: int, best: dict[str, dict], base_of) -> None:
    """One row per mode in results["runs"], with whether its tokens equal those of base_of(mode); printed too."""
    for mode, r in best.items():
        row = {"batch": batch, "mode": mode, "lossless": r["outputs"] == best[base_of(mode)]["outputs"],
               **{k: v for k, v in r.items() if k != "outputs"}}
        results["runs"].append(row)
        ms = r["per_step_ms"]
        print(f"B={batch:<3} {mode:<18} {r['tok_s']:8.1f} tok/s  step {ms['step']:.2f} ms  "
              + "  ".join(f"{p} {ms[p]:.2f}" for p in PARTS), flush=True)


def _base(mode: str) -> str:
    """The mode a row is compared with: no speculation, compiled alike."""
    return "none" + (mode[mode.index(" ["):] if " [" in mode else "")


def summarize(results: dict) -> str:
    lines = [f"# Speculative step cost on CPU ({results['device']})", "",
             f"Zoo target `{results['zoo']}`, greedy, up to {results['max_tokens']} new tokens, held-out JSON "
             f"prompts; modes alternate in one process, best of {results['repeats']}. Load average before "
             f"{results['load_before'][0]:.2f}, after {results['load_after'][0]:.2f} (2 shared cores).", "",
             "Per decode step, CPU ms of the engine's thread (host = scheduling, batch tensors, the step's small "
             "ops, copy-out, update); wall ms per step beside it:", "",
             "| batch | mode | tok/s | vs none | accepted | wall ms | step ms | step vs none | "
             + " | ".join(PARTS) + " | lossless |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(PARTS) + "---|"]
    runs = results["runs"]
    for r in runs:
        base = next(b for b in runs if b["batch"] == r["batch"] and b["mode"] == _base(r["mode"]))
        ms, acc = r["per_step_ms"], r["mean_accepted_length"]
        lines.append(f"| {r['batch']} | {r['mode']} | {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x | "
                     f"{'' if acc is None else f'{acc:.2f}'} | {ms['wall']:.2f} | {ms['step']:.2f} | "
                     f"{ms['step'] / base['per_step_ms']['step']:.2f}x | "
                     + " | ".join(f"{ms[p]:.2f}" for p in PARTS) + f" | {'yes' if r['lossless'] else 'NO'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--zoo", default=None, help="a built zoo directory (default: the prebuilt one)")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--prompts", type=int, default=4, help="prompts at batch 1 (2B at batch B)")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--name", default="spec_step_cpu")
    p.add_argument("--cpu-compile", default="off", choices=["off", "gemm", "layers"],
                   help="also run both modes with this EngineConfig.cpu_compile (rows compare within a compile mode)")
    p.add_argument("--token-map", default=None, help="also run MTP k=3 with this token map (a hot draft vocabulary)")
    args = p.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    results = bench(args)
    table = summarize(results)
    print(table)
    print(f"wrote {write_results(args.name, results, table)}")


if __name__ == "__main__":
    main()
