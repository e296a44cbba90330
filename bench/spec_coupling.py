"""Coupled verification against rejection sampling: mean accepted length of the zoo's MTP and EAGLE-3 heads.

Verification checks a sampled draft one of two ways (engine/sample/verify.py): coupled (the draft is accepted
iff it equals the target's own seeded draw at its position; exact whatever the schedule, used for requests
with a seed) or rejection sampling (accepted with probability min(1, p/q); the optimal single-draft
acceptance 1 - TV(p, q); used for requests whose seed the engine drew). Both run in the same engine on the
same prompts in the same batch: every prompt is sent twice, once with a seed (coupled) and once without
(rejection), at each temperature; drafts are drawn the same way for both (the race on the target's numbers).
Also asserted: every seeded output equals the target's alone (no speculation).

    python -m bench.spec_coupling [--zoo DIR] [--prompts 12] [--max-tokens 64] [--k 3]

Writes bench/results/spec_coupling_cpu.{json,md}. Mean accepted length = tokens emitted per verification
step (accepted drafts + 1), k + 1 at most; +- is the standard error over steps.
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from bench.common import device_name, write_results
from bench.spec import load_prompts

METHODS = ("mtp", "eagle3")
TEMPERATURES = (0.8, 1.0)


def _mean_se(values: list[int]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / max(n - 1, 1)
    return mean, math.sqrt(var / n)


def run(zoo: Path, method: str, prompts: list[str], k: int, max_tokens: int, plain: dict) -> list[dict]:
    from engine import LLM, SamplingParams, SpecConfig

    llm = LLM(str(zoo / "target"), num_kv_blocks=2048, block_size=16, max_num_seqs=2 * len(prompts),
              speculative=SpecConfig(method, k, str(zoo / method)))
    rows = []
    for temperature in TEMPERATURES:
        seeded = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1000 + i, ignore_eos=True)
                  for i in range(len(prompts))]
        unseeded = [SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
                    for _ in prompts]
        start = time.perf_counter()
        outs = llm.generate(prompts + prompts, seeded + unseeded)
        seconds = time.perf_counter() - start
        n = len(prompts)
        want = plain.get(temperature)
        if want is not None:
            assert [o.token_ids for o in outs[:n]] == want, f"{method} T={temperature}: seeded outputs changed"
        for verification, group in (("coupled (seeded)", outs[:n]), ("rejection (unseeded)", outs[n:])):
            steps = [s for o in group for s in o.metrics.accepted_lengths]
            mean, se = _mean_se(steps)
            drafted = sum(o.metrics.num_draft_tokens for o in group)
            accepted = sum(o.metrics.num_accepted_tokens for o in group)
            rows.append({"method": method, "temperature": temperature, "verification": verification,
                         "mean_accepted_length": mean, "stderr": se, "steps": len(steps),
                         "draft_acceptance": accepted / max(drafted, 1), "seconds_batch": seconds})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zoo", type=Path, default=None)
    ap.add_argument("--prompts", type=int, default=12, help="prompts per source (JSON schema, HumanEval)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import zoo as zoo_pkg
    from engine import LLM, SamplingParams

    root = args.zoo or Path(zoo_pkg.ensure_built(zoo_pkg.DEFAULT_SIZE))
    sources = load_prompts(args.prompts)
    prompts = sources["json"] + sources["humaneval"]
    target = LLM(str(root / "target"), num_kv_blocks=2048, block_size=16, max_num_seqs=len(prompts))
    plain = {t: [o.token_ids for o in target.generate(prompts, [
        SamplingParams(max_tokens=args.max_tokens, temperature=t, seed=1000 + i, ignore_eos=True)
        for i in range(len(prompts))])] for t in TEMPERATURES}
    rows = [r for m in METHODS for r in run(root, m, prompts, args.k, args.max_tokens, plain)]
    table = [f"Mean accepted length (tokens per verification step, at most k + 1 = {args.k + 1}), zoo heads, "
             f"{len(prompts)} prompts x {args.max_tokens} tokens, each prompt seeded and unseeded in one batch; "
             f"{device_name('cpu')}", "",
             "| method | T | verification | mean accepted length | draft acceptance | steps |", "|---|---|---|---|---|---|"]
    for r in rows:
        table.append(f"| {r['method']} | {r['temperature']} | {r['verification']} | {r['mean_accepted_length']:.3f} "
                     f"+- {r['stderr']:.3f} | {r['draft_acceptance']:.3f} | {r['steps']} |")
    table += ["", "Every seeded output equals the target's alone (asserted)."]
    print(write_results("spec_coupling_cpu", {"device": device_name("cpu"), "k": args.k, "zoo": str(root),
                                              "rows": rows}, "\n".join(table)))


if __name__ == "__main__":
    main()
