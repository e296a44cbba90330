"""Structured outputs on JSONSchemaBench-format cases (issue 11, "Measured").

Part 1, grammar faithfulness (no model): per case, compile the schema the way the engine does
(structured.request.compile_structured: compact JSON, ", " and ": " separators), then feed each of the
case's instances, serialized as that grammar expects, to a fresh xgrammar matcher: a valid instance
should complete the grammar, an invalid one should not. A schema xgrammar would not enforce
(structured.schema.support.first_unenforceable) goes, as in the engine, to llguidance
(structured/llguidance.py: same options, same validation, the engine's LLGuidanceState fed the
instance's tokens and then EOS); it is served if llguidance accepts it, else refused (a 400).
Reported per subset and overall, for all compiled cases (xgrammar) and for the served ones (each by
the backend that serves it), per backend, plus compile rate and compile time. Keywords present in
the schemas whose invalid instances were accepted are counted, to decide what to refuse.

    nice -n 10 python -m bench.structured [--cases DIR] [--limit N] [--tokenizer DIR]

Case files: `<subset>---<name>.json` = {"description", "meta", "schema", "tests": [{"valid", "data"}]}.
Each case runs in a child process that is killed past --timeout (xgrammar has no compile timeout).
More parts (completion and validity on the zoo target, acceptance with draft masks, guided vs
unguided throughput) are to be added as further `--part`s writing their own result files.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench.common import write_results
from structured import llguidance as llg
from structured.compile_worker import CompileWorker, WorkerFailed, WorkerTimeout
from structured.compiler import compile_structured, llguidance_schema
from structured.request import StructuredOutput
from structured.schema.rewrite import rewrite
from structured.schema.support import first_unenforceable
from structured.schema.walk import ANNOTATIONS, UNRESOLVED, follow_pointer

DEFAULT_CASES = Path("/work/shared/data/jsonschemabench/cases")


# ------------------------------------------------------------------------------------------ cases
def subset_of(path: Path) -> str:
    """The name's prefix before `---`; names without one lose a trailing `_<number>` (BFCL_simple_12)."""
    stem = path.stem
    return stem.split("---", 1)[0] if "---" in stem else re.sub(r"_\d+$", "", stem)


def sample_cases(cases_dir: Path, limit: int | None) -> list[Path]:
    """All case files, or `limit` of them spread over the subsets in proportion to their sizes (at
    least one each), evenly spaced in name order within each subset: deterministic, no RNG."""
    by_subset: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(cases_dir.glob("*.json")):
        by_subset[subset_of(path)].append(path)
    total = sum(len(v) for v in by_subset.values())
    if limit is None or limit >= total:
        return [p for k in sorted(by_subset) for p in by_subset[k]]
    picked = []
    for name in sorted(by_subset):
        files = by_subset[name]
        take = max(1, round(limit * len(files) / total))
        picked += [files[i * len(files) // take] for i in range(min(take, len(files)))]
    return picked


# ------------------------------------------------------------------------------- serialization
def _resolve(schema, root, depth: int = 0):
    """Follow local $refs ("#/..."), at most a few hops; anything else is returned as is."""
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and depth < 8:
        ref = schema["$ref"]
        node = follow_pointer(root, ref) if ref.startswith("#") else UNRESOLVED
        if node is UNRESOLVED:
            return schema
        schema, depth = node, depth + 1
    return schema


def _declared(schema, root, depth: int = 0) -> dict:
    """name -> subschema of the properties a schema declares, in declaration order, through $ref
    and allOf/anyOf/oneOf branches (first declaration wins)."""
    schema = _resolve(schema, root)
    if not isinstance(schema, dict) or depth > 8:
        return {}
    props = dict(schema["properties"]) if isinstance(schema.get("properties"), dict) else {}
    for key in ("allOf", "anyOf", "oneOf"):
        for branch in schema.get(key, []) if isinstance(schema.get(key), list) else []:
            for name, sub in _declared(branch, root, depth + 1).items():
                props.setdefault(name, sub)
    return props


def in_schema_order(instance, schema, root):
    """The instance with object keys in the order the schema declares them (the engine's grammar
    generates properties in that order); undeclared keys keep their order after them. Key order does
    not change validity, so valid stays valid and invalid stays invalid."""
    schema = _resolve(schema, root)
    if isinstance(instance, dict):
        props = _declared(schema, root)
        rank = {name: i for i, name in enumerate(props)}
        keys = sorted(instance, key=lambda k: rank.get(k, len(rank)))
        extra = schema.get("additionalProperties") if isinstance(schema, dict) else None
        return {k: in_schema_order(instance[k], props.get(k, extra), root) for k in keys}
    if isinstance(instance, list):
        items = schema.get("items") if isinstance(schema, dict) else None
        prefix = schema.get("prefixItems") if isinstance(schema, dict) else None
        out = []
        for i, v in enumerate(instance):
            sub = prefix[i] if isinstance(prefix, list) and i < len(prefix) else (
                items[i] if isinstance(items, list) and i < len(items) else items)
            out.append(in_schema_order(v, sub, root))
        return out
    return instance


def serialize(instance, schema) -> str:
    """As the engine's compact JSON grammar writes it: one line, ", " and ": ", UTF-8 text."""
    return json.dumps(in_schema_order(instance, schema, schema), separators=(", ", ": "), ensure_ascii=False)


def keywords(schema) -> set[str]:
    """Every non-annotation keyword used anywhere in a schema (under property names it is a name)."""
    found: set[str] = set()
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for k, v in node.items():
                if k in ANNOTATIONS:
                    continue
                found.add(k)
                if k in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") and isinstance(v, dict):
                    stack.extend(v.values())
                elif k not in ("enum", "const", "required", "type", "$ref", "pattern", "format"):
                    stack.append(v)
    return found


# ------------------------------------------------------------------------------ the child process
class _Backends:
    """The child's state: an xgrammar compiler and llguidance's tokenizer for one HF tokenizer."""

    def __init__(self, tokenizer_dir: str):
        import xgrammar as xgr
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        self.eos = self.tokenizer.eos_token_id
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, stop_token_ids=[self.eos])
        self.xgrammar = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.lltokenizer = None
        if llg.available():
            self.lltokenizer = llg.tokenizer_of(llg.hf_tokenizer_json(self.tokenizer), len(self.tokenizer), [self.eos])


def _check(backends: _Backends, schema_text: str, instances: list[tuple[bool, str]], llguidance: bool) -> dict:
    """Compile, then for each instance: did the matcher accept all of it and complete? With
    `llguidance`, the same for llguidance (`llg_*` fields) as the engine would serve the schema."""
    import xgrammar as xgr

    structured = StructuredOutput(json_schema=schema_text)
    out = {}
    if llguidance:
        out.update(_check_llguidance(backends, structured, instances))
    t0 = time.perf_counter()
    try:
        compiled = compile_structured(backends.xgrammar, structured)
    except Exception as e:
        return {**out, "compiled": False, "error": str(e)[:200]}
    compile_s = time.perf_counter() - t0
    accepted = []
    for _valid, text in instances:
        matcher = xgr.GrammarMatcher(compiled)
        accepted.append(bool(matcher.accept_string(text) and matcher.is_completed()))
    return {**out, "compiled": True, "compile_s": compile_s, "accepted": accepted}


def _check_llguidance(backends: _Backends, structured: StructuredOutput, instances: list[tuple[bool, str]]) -> dict:
    t0 = time.perf_counter()
    try:
        schema = llguidance_schema(structured)
        llg.check_gaps(schema, structured.plan.refusal)
        text = llg.grammar_text(schema)
        grammar = llg.load(llg.validated(text, backends.lltokenizer, structured.plan.refusal), backends.lltokenizer)
    except Exception as e:  # noqa: BLE001 - llguidance refuses it: the engine answers 400
        return {"llg_served": False, "llg_error": str(e).rsplit("either (", 1)[-1][:200]}
    compile_s = time.perf_counter() - t0
    accepted = []
    for _valid, text in instances:
        state = llg.LLGuidanceState(grammar.template.deep_copy(), frozenset([backends.eos]))
        ids = backends.tokenizer.encode(text, add_special_tokens=False)
        accepted.append(all(state.accept(t) for t in ids) and state.accept(backends.eos))
    return {"llg_served": True, "llg_compile_s": compile_s, "llg_accepted": accepted}


# ------------------------------------------------------------------------------------- measuring
def run_faithfulness(paths: list[Path], tokenizer_dir: str, timeout: float) -> list[dict]:
    worker = CompileWorker(_Backends, (tokenizer_dir,))
    rows = []
    t_start = time.perf_counter()
    for n, path in enumerate(paths):
        case = json.loads(path.read_text())
        schema = case["schema"]
        refused = first_unenforceable(rewrite(schema))
        use_llguidance = refused is not None and isinstance(schema, dict) and llg.available()
        instances = []
        for test in case.get("tests", []):
            try:
                instances.append((bool(test["valid"]), serialize(test["data"], schema)))
            except (TypeError, ValueError, RecursionError):
                pass
        row = {"case": path.name, "subset": subset_of(path), "keywords": sorted(keywords(schema)),
               "xgrammar_refused": None if refused is None else f"{refused.keyword} at {refused.path}",
               "valid": [v for v, _ in instances]}
        try:
            row.update(worker.call(_check, json.dumps(schema), instances, use_llguidance, timeout=timeout))
        except WorkerTimeout:
            row.update(compiled=False, error=f"timeout {timeout:g} s", timed_out=True)
        except WorkerFailed as e:
            row.update(compiled=False, error=f"{e.kind}: {str(e)[:200]}")
        # who serves it: xgrammar if it enforces every keyword, else llguidance if it accepts the schema
        row["backend"] = ("xgrammar" if refused is None and row["compiled"] else
                          "llguidance" if row.get("llg_served") else None)
        row["refused"] = None if refused is None or row.get("llg_served") else row["xgrammar_refused"]
        rows.append(row)
        if (n + 1) % 250 == 0:
            print(f"  {n + 1}/{len(paths)} cases, {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    worker.close()
    return rows


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def served_accepted(row: dict) -> list[bool]:
    """The instances accepted by the backend that serves the case."""
    return row["llg_accepted"] if row["backend"] == "llguidance" else row["accepted"]


def _rates(group: list[dict], accepted=lambda r: r["accepted"]) -> dict:
    va = sum(a for r in group for a, v in zip(accepted(r), r["valid"]) if v)
    vn = sum(v for r in group for v in r["valid"])
    ir = sum(not a for r in group for a, v in zip(accepted(r), r["valid"]) if not v)
    inn = sum(not v for r in group for v in r["valid"])
    leaky = sum(any(a and not v for a, v in zip(accepted(r), r["valid"])) for r in group)
    return {"cases": len(group), "valid_accepted": va / vn if vn else None, "valid_n": vn,
            "invalid_rejected": ir / inn if inn else None, "invalid_n": inn, "cases_with_invalid_accepted": leaky}


def summarize(rows: list[dict]) -> dict:
    """"all": every case xgrammar compiles, as xgrammar alone would treat it; "served": every case the
    engine serves, by its backend (also split per backend)."""
    compiled = [r for r in rows if r["compiled"]]
    served = [r for r in rows if r["backend"] is not None]
    times = [r["compile_s"] for r in compiled]
    return {"cases": len(rows), "compiled": len(compiled), "compile_rate": len(compiled) / len(rows) if rows else None,
            "timeouts": sum(bool(r.get("timed_out")) for r in rows),
            "refused": sum(r["refused"] is not None for r in rows),
            "refusal_rate": sum(r["refused"] is not None for r in rows) / len(rows) if rows else None,
            "compile_ms_p50": None if not times else 1e3 * _pct(times, 0.5),
            "compile_ms_p99": None if not times else 1e3 * _pct(times, 0.99),
            "all": _rates(compiled), "served": _rates(served, served_accepted),
            "by_backend": {b: _rates([r for r in served if r["backend"] == b], served_accepted)
                           for b in ("xgrammar", "llguidance")}}


def leaks_by_keyword(rows: list[dict]) -> list[dict]:
    """For each keyword: in how many compiled cases with invalid instances it appears, and how many of
    those accepted an invalid instance (a keyword's leak share well above the base rate marks it)."""
    with_invalid = [r for r in rows if r["compiled"] and not all(r["valid"])]
    seen, leaked = Counter(), Counter()
    for r in with_invalid:
        leak = any(a and not v for a, v in zip(r["accepted"], r["valid"]))
        for k in r["keywords"]:
            seen[k] += 1
            leaked[k] += leak
    return sorted(({"keyword": k, "cases": seen[k], "leaky": leaked[k], "share": leaked[k] / seen[k]}
                   for k in seen), key=lambda d: (-d["leaky"], d["keyword"]))


def _fmt(x, pct: bool = True) -> str:
    if x is None:
        return "-"
    return f"{100 * x:.1f}%" if pct else f"{x:.1f}"


def table(summary: dict, by_subset: dict[str, dict], tokenizer: str) -> str:
    head = ("| subset | cases | compiled | refused | compile p50 / p99 ms | valid accepted (all / served) "
            "| invalid rejected (all / served) | cases leaking (all / served) |\n|---|---|---|---|---|---|---|---|\n")

    def line(name: str, s: dict) -> str:
        return (f"| {name} | {s['cases']} | {_fmt(s['compile_rate'])} | {_fmt(s['refusal_rate'])} "
                f"| {_fmt(s['compile_ms_p50'], False)} / {_fmt(s['compile_ms_p99'], False)} "
                f"| {_fmt(s['all']['valid_accepted'])} / {_fmt(s['served']['valid_accepted'])} "
                f"| {_fmt(s['all']['invalid_rejected'])} / {_fmt(s['served']['invalid_rejected'])} "
                f"| {s['all']['cases_with_invalid_accepted']} / {s['served']['cases_with_invalid_accepted']} |\n")

    body = "".join(line(k, v) for k, v in sorted(by_subset.items())) + line("**all**", summary)
    backends = ("\n| backend | cases served | valid accepted | invalid rejected | cases leaking |\n|---|---|---|---|---|\n"
                + "".join(f"| {b} | {s['cases']} | {_fmt(s['valid_accepted'])} of {s['valid_n']} "
                          f"| {_fmt(s['invalid_rejected'])} of {s['invalid_n']} | {s['cases_with_invalid_accepted']} |\n"
                          for b, s in summary["by_backend"].items()))
    return (f"# Structured outputs: grammar faithfulness (xgrammar + llguidance, compact JSON)\n\n"
            f"Tokenizer: `{tokenizer}`. \"all\" = every case xgrammar compiles, judged by xgrammar; \"served\" "
            f"= the cases the engine serves (xgrammar where structured.schema.support finds nothing it would not "
            f"enforce, else llguidance where it accepts the schema), each judged by its backend.\n\n{head}{body}{backends}")


def default_tokenizer(tmp: Path) -> str:
    """The zoo's tokenizer if a zoo is built (never builds one), else a tiny byte-level BPE made here."""
    try:
        import zoo

        root = zoo.built_path()
        if root is not None:
            return str(zoo.layout(root).tokenizer)
    except Exception:
        pass
    from engine.testing import save_tiny_tokenizer

    text = ['{"name": "Ada", "age": 36, "tags": ["a", "b"], "ok": true, "x": null}',
            "The quick brown fox jumps over the lazy dog. 0123456789"] * 20
    save_tiny_tokenizer(tmp, 512, text)
    return str(tmp)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=Path, default=DEFAULT_CASES, help="directory of JSONSchemaBench-format case files")
    ap.add_argument("--limit", type=int, default=None, help="a subset-stratified sample of this many cases")
    ap.add_argument("--tokenizer", default=None, help="HF tokenizer directory (default: the zoo's, or a tiny one)")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds per case (compile + matching)")
    ap.add_argument("--name", default="structured_faithfulness_cpu", help="result file name under bench/results")
    args = ap.parse_args(argv)
    if not args.cases.is_dir():
        sys.exit(f"no case directory at {args.cases}")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = args.tokenizer or default_tokenizer(Path(tmp))
        paths = sample_cases(args.cases, args.limit)
        t0 = time.perf_counter()
        rows = run_faithfulness(paths, tokenizer, args.timeout)
        wall = time.perf_counter() - t0
    by_subset = {name: summarize([r for r in rows if r["subset"] == name]) for name in sorted({r["subset"] for r in rows})}
    summary = summarize(rows)
    refused_by = Counter(r["refused"].split(" at ")[0] for r in rows if r["refused"])
    llg_served_by = Counter(r["xgrammar_refused"].split(" at ")[0] for r in rows if r["backend"] == "llguidance")
    llg_why = Counter(r["llg_error"].split(":")[0][:60] for r in rows if r.get("llg_served") is False)
    leaking = [{"case": r["case"], "refused": r["refused"], "backend": r["backend"]} for r in rows
               if r["compiled"] and any(a and not v for a, v in zip(r["accepted"], r["valid"]))]
    served_leaking = [{"case": r["case"], "backend": r["backend"]} for r in rows if r["backend"] is not None
                      and any(a and not v for a, v in zip(served_accepted(r), r["valid"]))]
    md = table(summary, by_subset, tokenizer if args.tokenizer else "default")
    md += ("\nRefused (neither backend), by xgrammar's keyword: "
           + ", ".join(f"`{k}` {n}" for k, n in refused_by.most_common())
           + "\n\nServed by llguidance, by xgrammar's keyword: "
           + ", ".join(f"`{k}` {n}" for k, n in llg_served_by.most_common())
           + "\n\nllguidance's own refusals: " + ", ".join(f"{k} {n}" for k, n in llg_why.most_common(8))
           + f"\n\nWall time {wall:.0f} s for {len(rows)} cases.")
    payload = {"cases_dir": str(args.cases), "tokenizer": tokenizer, "limit": args.limit, "wall_s": wall,
               "overall": summary, "by_subset": by_subset, "refused_by_keyword": dict(refused_by),
               "llguidance_served_by_keyword": dict(llg_served_by), "llguidance_refusals": dict(llg_why),
               "leaks_by_keyword": leaks_by_keyword(rows), "leaking_cases": leaking, "served_leaking_cases": served_leaking,
               "compile_failures": [{"case": r["case"], "error": r["error"]} for r in rows if not r["compiled"]]}
    print(md)
    print(write_results(args.name, payload, md))


if __name__ == "__main__":
    # The compile child is a fresh interpreter that finds functions by module name: run them from the
    # imported module, not from __main__ (which the child cannot import).
    from bench.structured import main as _main

    _main()
