"""Would llguidance, as a second grammar backend, serve the schemas xgrammar cannot be trusted with?
(issue 11, "enforce or refuse": measure a second backend before adding one.)

For every case structured.schema.support still refuses (after structured.schema.rewrite), compile the case's
schema with llguidance (compact JSON: ", " and ": ", no free whitespace, oneOf NOT coerced to anyOf)
and, where llguidance accepts it, feed each valid and invalid instance (serialized as the engine's
grammar writes it, tokenized by the zoo tokenizer) to an LLMatcher. llguidance refuses what it cannot
enforce itself, so "serves" counts schemas it compiles, and a leak is an invalid instance it accepts.

This was the measurement that decided to add llguidance; it is now the engine's second backend
(structured/llguidance.py), and bench/structured.py reports what the engine serves with it (per
backend, with the key-presence rewrites of structured/schema/presence.py, which this script leaves out).

    python -m bench.structured_llguidance [--cases DIR]
"""
from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

from bench.common import write_results
from bench.structured import DEFAULT_CASES, serialize, subset_of
from structured.schema.rewrite import rewrite
from structured.schema.support import first_unenforceable

OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": False}


def main(argv: list[str] | None = None) -> None:
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    import zoo

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=Path, default=DEFAULT_CASES)
    args = ap.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(str(zoo.layout(zoo.ensure_built()).tokenizer))
    lltok = llguidance.hf.from_tokenizer(tok)
    counts, why, leaking, served_by_keyword = Counter(), Counter(), [], Counter()
    t0 = time.perf_counter()
    for path in sorted(args.cases.glob("*.json")):
        case = json.loads(path.read_text())
        schema = case["schema"]
        counts["cases"] += 1
        refused = first_unenforceable(rewrite(schema))
        if refused is None or not isinstance(schema, dict):
            continue
        counts["refused"] += 1
        grammar = llguidance.LLMatcher.grammar_from_json_schema({**schema, "x-guidance": OPTIONS})
        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error:
            why[error.split(":")[0][:60]] += 1
            continue
        counts["llguidance_serves"] += 1
        served_by_keyword[refused.keyword] += 1
        leak = False
        for test in case["tests"]:
            ids = tok.encode(serialize(test["data"], schema), add_special_tokens=False)
            matcher = llguidance.LLMatcher(lltok, grammar)
            accepted = matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
            counts[("valid" if test["valid"] else "invalid") + ("_accepted" if accepted else "_rejected")] += 1
            leak |= accepted and not test["valid"]
        if leak:
            leaking.append(f"{subset_of(path)}/{path.name}")
    wall = time.perf_counter() - t0
    n, r, s = counts["cases"], counts["refused"], counts["llguidance_serves"]
    vn = counts["valid_accepted"] + counts["valid_rejected"]
    inn = counts["invalid_accepted"] + counts["invalid_rejected"]
    md = ("# llguidance as a second backend for the schemas xgrammar is refused (JSONSchemaBench dev cases)\n\n"
          f"llguidance {getattr(llguidance, 'get_version', lambda: '?')()}, compact JSON, oneOf not coerced.\n\n"
          f"| cases | refused now | llguidance serves of those | refused with both | valid accepted | invalid rejected | cases leaking |\n"
          f"|---|---|---|---|---|---|---|\n"
          f"| {n} | {r} ({100 * r / n:.1f}%) | {s} | {r - s} ({100 * (r - s) / n:.1f}%) "
          f"| {100 * counts['valid_accepted'] / max(vn, 1):.1f}% of {vn} | {100 * counts['invalid_rejected'] / max(inn, 1):.1f}% of {inn} "
          f"| {len(leaking)} |\n\n"
          "Served by llguidance, by the keyword we refuse them for: "
          + ", ".join(f"`{k}` {v}" for k, v in served_by_keyword.most_common())
          + "\n\nllguidance's own refusals: " + ", ".join(f"{k} {v}" for k, v in why.most_common(8))
          + f"\n\nWall time {wall:.0f} s.\n")
    print(md)
    print(write_results("structured_llguidance_cpu", {"counts": dict(counts), "why": dict(why), "leaking": leaking,
                                                      "served_by_keyword": dict(served_by_keyword)}, md))


if __name__ == "__main__":
    main()
