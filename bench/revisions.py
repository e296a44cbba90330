"""The engine's decode speed at two git revisions, measured in the same run (A/B, interleaved).

On a shared machine absolute tokens/s drift from minute to minute; a refactor's cost is the ratio of
the two revisions measured back to back, several rounds, keeping each one's best. Each revision runs
from its own `git worktree` in a fresh process (so nothing of one is imported by the other), on the
same checkpoints: the random Llama of bench/engine.py (no speculation, batch 1 and 16) and, with the
target as its own draft model (every draft accepted: the step's own cost, not a head's quality),
speculation with k = 3 at batch 1, plus prompt lookup at k = 3.

    python -m bench.revisions --base 13e2390 [--head HEAD] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import device_name, write_results

CASES = [  # (name, speculative config or None, batch)
    ("none b1", None, 1),
    ("none b16", None, 16),
    ("self-draft k3 b1", {"method": "draft_model", "k": 3}, 1),
    ("ngram k3 b1", {"method": "ngram", "k": 3}, 1),
]


def worker(model: str, new_tokens: int, threads: int, only: set[str] | None = None) -> None:
    """Runs inside a revision's worktree: one line of JSON, tokens/s per case."""
    import torch

    torch.set_num_threads(threads)
    import engine
    from bench.engine import BENCH_CONFIG, prompts, run_tandem
    from engine import LLM

    out = {"engine_path": engine.__file__}
    for name, spec, batch in CASES:
        if only and name not in only:
            continue
        if spec is not None and spec["method"] == "draft_model":
            spec = {**spec, "draft": model}
        llm = LLM(model, max_num_seqs=64, num_kv_blocks=1024, block_size=16, speculative=spec)
        reqs = prompts(batch, 64, BENCH_CONFIG["vocab_size"])
        run_tandem(llm, reqs, 8)  # warm-up
        seconds, tokens = run_tandem(llm, reqs, new_tokens)
        out[name] = tokens / seconds
    print(json.dumps(out), flush=True)


def _worktree(rev: str, root: Path) -> Path:
    path = root / rev.replace("/", "_")
    subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], check=True, capture_output=True)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="the baseline revision")
    ap.add_argument("--head", default="HEAD")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--name", default="revisions_cpu")
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.new_tokens, args.threads, set(args.cases.split(",")) if args.cases else None)
        return 0

    import torch

    from bench.engine import BENCH_CONFIG, make_model

    revs = {args.base: subprocess.run(["git", "rev-parse", "--short", args.base], capture_output=True, text=True,
                                      check=True).stdout.strip(),
            args.head: subprocess.run(["git", "rev-parse", "--short", args.head], capture_output=True, text=True,
                                      check=True).stdout.strip()}
    best: dict[str, dict[str, float]] = {r: {} for r in revs}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = str(root / "model")
        make_model(model, BENCH_CONFIG, torch.float32)
        trees = {r: _worktree(revs[r], root) for r in revs}
        script = root / "revision_worker.py"
        shutil.copy(__file__, script)
        try:
            for i in range(args.rounds):
                for r in (list(revs) if i % 2 == 0 else list(reversed(revs))):  # alternate who runs first
                    # This file runs from outside both trees, importing each tree's own engine and bench.
                    cmd = [sys.executable, str(script), "--base", "x", "--worker", model,
                           "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
                    cmd += ["--cases", args.cases] if args.cases else []
                    res = subprocess.run(cmd, cwd=trees[r], capture_output=True, text=True, check=False,
                                         env={**os.environ, "PYTHONPATH": str(trees[r])})
                    if res.returncode != 0:
                        raise SystemExit(f"revision {revs[r]} failed:\n{res.stderr[-3000:]}")
                    measured = json.loads(res.stdout.strip().splitlines()[-1])
                    assert measured.pop("engine_path").startswith(str(trees[r])), "imported the wrong tree's engine"
                    for name, tps in measured.items():
                        best[r][name] = max(best[r].get(name, 0.0), tps)
                    print(f"round {i + 1} {revs[r]}: {best[r]}", flush=True)
        finally:
            for r in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(r)], capture_output=True)
    base, head = args.base, args.head
    rows = [f"| {name} | {best[base][name]:.1f} | {best[head][name]:.1f} | {best[head][name] / best[base][name]:.2f}x |"
            for name, _, _ in CASES if name in best[head]]
    table = "\n".join([
        f"# Engine decode speed, {revs[head]} vs {revs[base]}, on {device_name('cpu')}",
        f"Random Llama of bench/engine.py ({BENCH_CONFIG['num_hidden_layers']} layers, fp32), greedy, "
        f"{args.new_tokens} new tokens, prompts ~64 tokens, torch threads {args.threads}; each revision in its own "
        f"worktree and process, {args.rounds} interleaved rounds, best tok/s of each kept. The target is its own "
        f"draft model in `self-draft` (every draft accepted).", "",
        f"| case | {revs[base]} tok/s | {revs[head]} tok/s | ratio |", "|---|---|---|---|", *rows])
    print(write_results(args.name, {"when": time.time(), "base": revs[base], "head": revs[head], "best": best},
                        table).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
