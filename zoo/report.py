"""Writes `tandem zoo eval` results: bench/results/zoo_eval.json and a markdown table beside it."""
from __future__ import annotations

import json
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent.parent / "bench" / "results"


def markdown(result: dict) -> str:
    agree = result["agreement"]
    lines = [
        f"# Zoo evaluation: `{result['recipe']}` (seed {result['seed']}, "
        f"{result['target_parameters'] / 1e6:.1f}M-parameter target)",
        "",
        "Held-out data only: schemas, stdlib modules and GSM8K problems that no model trained on.",
        "",
        "## Target loss (nats/token)",
        "",
        "| domain | loss | perplexity |",
        "|---|---|---|",
    ]
    for domain, loss in result["target_loss"].items():
        lines.append(f"| {domain} | {loss:.3f} | {result['target_perplexity'][domain]:.1f} |")
    depth = max(len(v) for k, v in agree.items() if k != "positions")
    lines += ["", "## Teacher-forced top-1 agreement with the target (held-out JSON documents)", "",
              "| model | positions | " + " | ".join(f"depth {d + 1}" for d in range(depth)) + " |",
              "|---|---|" + "---|" * depth]
    for key, values in agree.items():
        if key == "positions":
            continue
        model, scope = key.split("/")
        cells = [f"{v:.3f}" for v in values] + ["" for _ in range(depth - len(values))]
        lines.append(f"| {model} | {scope} | " + " | ".join(cells) + " |")
    gen = result["generation"]
    lines += ["", "## Greedy generation on held-out schema prompts", "",
              f"{gen['prompts']} prompts: {gen['parses_as_json']:.0%} parse as JSON"
              + (f", {gen['satisfies_schema']:.0%} satisfy their schema." if gen["satisfies_schema"] is not None else "."),
              "", f"Evaluated in {result['eval_seconds']} s."]
    return "\n".join(lines) + "\n"


def write_results(result: dict, out_dir: Path = RESULTS_DIR, stem: str = "zoo_eval") -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    md_path.write_text(markdown(result))
    return json_path, md_path
