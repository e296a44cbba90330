"""Writes `tandem zoo eval` results: bench/results/zoo_eval.json and a markdown table beside it."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"


GOALS = (  # (label, how to read it from a result, goal, higher is better) from issue 13
    ("unconstrained greedy output parses as JSON", lambda r: r["generation"]["parses_as_json"], 0.5, True),
    ("unconstrained greedy output satisfies the schema", lambda r: r["generation"]["satisfies_schema"], 0.3, True),
    ("constrained output finishes within the budget", lambda r: r["constrained"]["finished"], 0.95, True),
    ("degenerate outputs (a 4-gram repeats >= 4 times)", lambda r: r["generation"]["degenerate"], 0.1, False),
    *((f"{head} top-1 agreement, depth {d + 1} (instance)", lambda r, h=head, d=d: r["agreement"][f"{h}/instance"][d],
       0.8, True) for head in ("mtp", "eagle3") for d in range(3)),
    *((f"{head} accepted per step minus ngram's (k drafts)",
       lambda r, h=head: round(r["acceptance"][h] - r["acceptance"]["ngram"], 4), 0.0, True) for head in ("mtp", "eagle3")),
    *((f"{head} minus ngram on natural text (k drafts)",
       lambda r, h=head: round(r["acceptance_text"][h] - r["acceptance_text"]["ngram"], 4), 0.0, True)
      for head in ("mtp", "eagle3")),
)


def _read(read, result: dict | None) -> str:
    try:
        return f"{read(result):.3f}"
    except (KeyError, TypeError, IndexError):  # no baseline, or one from an eval that lacked the metric
        return ""


def _goal_lines(result: dict) -> list[str]:
    base = result.get("baseline")
    name = (base or {}).get("recipe", "previous")
    lines = [f"| goal | target | measured | met | `{name}` |", "|---|---|---|---|---|"]
    for label, read, goal, higher in GOALS:
        value = read(result)
        met = value > goal if label.endswith("(k drafts)") else (value >= goal if higher else value <= goal)
        sign = ">" if label.endswith("(k drafts)") else (">=" if higher else "<=")
        lines.append(f"| {label} | {sign} {goal:g} | {value:.3f} | {'yes' if met else 'NO'} | {_read(read, base)} |")
    return lines


def _loss_lines(result: dict) -> list[str]:
    base = (result.get("baseline") or {}).get("target_loss") or {}
    name = (result.get("baseline") or {}).get("recipe", "previous")
    lines = [f"| domain | loss | perplexity | `{name}` loss |", "|---|---|---|---|"]
    for domain, loss in result["target_loss"].items():
        before = f"{base[domain]:.3f}" if domain in base else ""
        lines.append(f"| {domain} | {loss:.3f} | {result['target_perplexity'][domain]:.1f} | {before} |")
    return lines


def _agreement_lines(result: dict) -> list[str]:
    agree = result["agreement"]
    base = (result.get("baseline") or {}).get("agreement") or {}
    depth = max(len(v) for k, v in agree.items() if k not in ("positions", "by_confidence"))
    lines = ["| model | positions | " + " | ".join(f"depth {d + 1}" for d in range(depth)) + " | previous depth 1 |",
             "|---|---|" + "---|" * (depth + 1)]
    for key, values in agree.items():
        if key in ("positions", "by_confidence"):
            continue
        model, scope = key.split("/")
        cells = [f"{v:.3f}" for v in values] + ["" for _ in range(depth - len(values))]
        before = f"{base[key][0]:.3f}" if key in base else ""
        lines.append(f"| {model} | {scope} | " + " | ".join(cells) + f" | {before} |")
    return lines


def _confidence_lines(result: dict) -> list[str]:
    """Depth-1 agreement on the instance positions per band of the target's top-1 probability."""
    bands = result["agreement"].get("by_confidence")
    if not bands:
        return []
    edges = [*bands["bands"], 1.0]
    total = max(sum(bands["positions"]), 1)
    models = [k for k in bands if k not in ("bands", "positions")]
    lines = ["Depth 1 on the instance positions, by the target's top-1 probability at the position it predicts "
             "(where the target itself hesitates, a head can hardly guess its pick):", "",
             "| target top-1 probability | share of positions | " + " | ".join(models) + " |",
             "|---|---|" + "---|" * len(models)]
    for b, n in enumerate(bands["positions"]):
        span = f"[{edges[b]:.1f}, {edges[b + 1]:.1f}" + ("]" if b == len(bands["positions"]) - 1 else ")")
        lines.append(f"| {span} | {n / total:.0%} | " + " | ".join(f"{bands[m][b]:.3f}" for m in models) + " |")
    return ["", *lines]


def _sample_lines(samples: list[dict]) -> list[str]:
    lines = []
    for sample in samples:
        flags = ", ".join(f"{k}: {v}" for k, v in sample.items() if k not in ("schema", "output", "prompt"))
        head = f"- `{sample['schema']}`" + (f" ({flags})" if flags else "") + ":"
        if "prompt" in sample:
            head += f" {sample['prompt']}"
        lines += [head, "", "  ```", *(f"  {line}" for line in sample["output"].splitlines() or [""]), "  ```"]
    return lines


def markdown(result: dict) -> str:
    gen, grammar, accept = result["generation"], result["constrained"], result["acceptance"]
    build = result["build"]
    lines = [
        f"# Zoo evaluation: `{result['recipe']}` (seed {result['seed']}, "
        f"{result['target_parameters'] / 1e6:.1f}M-parameter target)",
        "",
        "Held-out data only: schemas, stdlib modules and GSM8K problems that no model trained on. "
        f"Built in {build.get('build_seconds')} s (peak RSS {build.get('peak_rss_mb')} MB); "
        f"evaluated in {result['eval_seconds']} s.",
        "",
        "## Goals (issue 13)",
        "",
        *_goal_lines(result),
        "",
        "## Target loss (nats/token)",
        "",
        "The previous zoo's tokenizer is another 4096-token BPE, so per-token losses compare only roughly.",
        "",
        *_loss_lines(result),
        "",
        "## Teacher-forced top-1 agreement with the target (held-out JSON documents)",
        "",
        *_agreement_lines(result),
        *_confidence_lines(result),
        "",
        f"## Greedy generation on {gen['prompts']} held-out schema prompts ({gen['max_new_tokens']} new tokens)",
        "",
        f"Unconstrained: {gen['parses_as_json']:.0%} parse as JSON, {gen['satisfies_schema']:.0%} satisfy their "
        f"schema, {gen['degenerate']:.0%} degenerate, {gen['finished']:.0%} end with eos.",
        "",
        f"Under the schema's grammar (xgrammar's transformers logits processor, compact separators): "
        f"{grammar['compiled']} of {grammar['prompts']} schemas compile; of those {grammar['finished']:.0%} finish "
        f"and {grammar['satisfies_schema']:.0%} satisfy their schema.",
        "",
        f"## Speculation on those outputs: drafts accepted per step at k={accept['k']} (greedy, exact simulation)",
        "",
        "| drafter | accepted per step | steps | previous zoo |",
        "|---|---|---|---|",
        *(f"| {name} | {accept[name]:.3f} | {accept['steps'][name]} | "
          f"{_read(lambda r, n=name: r['acceptance'][n], result.get('baseline'))} |" for name in accept["steps"]),
        "",
        *_text_acceptance_lines(result),
        "## Sample outputs",
        "",
        "Unconstrained:",
        "",
        *_sample_lines(gen["samples"]),
        "",
        "Constrained:",
        "",
        *_sample_lines(grammar["samples"]),
        "",
        "Plain text (held-out GSM8K questions, greedy, 96 new tokens):",
        "",
        *_sample_lines(gen.get("text_samples", [])),
        *(["", f"Command: `{result['command']}`"] if result.get("command") else []),
    ]
    return "\n".join(lines) + "\n"


def write_results(result: dict, out_dir: Path = RESULTS_DIR, stem: str = "zoo_eval") -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown(result))
    return json_path, md_path


def _text_acceptance_lines(result: dict) -> list[str]:
    """The same simulation on the target's greedy answers to held-out GSM8K questions (natural text)."""
    accept = result.get("acceptance_text")
    if not accept:
        return []
    return [f"On natural text (greedy answers to {accept['prompts']} held-out GSM8K questions, 96 new tokens):", "",
            "| drafter | accepted per step | steps |", "|---|---|---|",
            *(f"| {name} | {accept[name]:.3f} | {accept['steps'][name]} |" for name in accept["steps"]), ""]
