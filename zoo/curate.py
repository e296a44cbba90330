"""Regenerates the curated data under zoo/data/ from the shared evaluation data (a maintainer tool).

    python -m zoo.curate --shared /work/shared/data

The zoo build never reads ../shared/data: it reads only what this writes, so a build is the same on
every machine. What it keeps (see zoo/data/SOURCE.md for attribution):

- jsonschemabench.jsonl.gz: JSONSchemaBench cases whose compact schema is at most MAX_SCHEMA_CHARS,
  deduplicated, capped per subset; each with up to two of the benchmark's valid instances and up to
  two instances drawn by zoo.schema_gen (checked with jsonschema). A schema's split ("train" or
  "heldout") is a hash of its family (its sorted top-level property names), so near-identical
  schemas never straddle the split. The zoo trains only on "train"; eval and benchmarks use "heldout".
- gsm8k.jsonl.gz: the first GSM8K training problems (question and worked answer), plain text.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
from pathlib import Path

from tqdm import tqdm

from zoo.prompts import instance_text, schema_text
from zoo.schema_gen import generate_instances, make_validator

DATA_DIR = Path(__file__).parent / "data"
MAX_SCHEMA_CHARS = 1000
MAX_INSTANCE_CHARS = 700
PER_SUBSET_CAP = 600
HELDOUT_PERCENT = 12
GSM8K_ITEMS = 1200
SEED = 20250101


def subset_of(name: str) -> str:
    if "---" in name:
        return name.split("---")[0]
    return name.rsplit("_", 1)[0]  # BFCL_simple_12 -> BFCL_simple


def family_key(schema) -> str:
    if isinstance(schema, dict) and isinstance(schema.get("properties"), dict) and schema["properties"]:
        return "props:" + ",".join(sorted(schema["properties"]))
    return "schema:" + schema_text(schema)


def split_of(schema) -> str:
    digest = hashlib.sha256(family_key(schema).encode()).digest()
    return "heldout" if int.from_bytes(digest[:4], "big") % 100 < HELDOUT_PERCENT else "train"


def curate_cases(cases_dir: Path) -> list[dict]:
    rng = random.Random(SEED)
    seen: set[str] = set()
    by_subset: dict[str, list[dict]] = {}
    for path in tqdm(sorted(cases_dir.glob("*.json")), desc="cases", unit="file"):
        case = json.loads(path.read_text())
        schema = case["schema"]
        text = schema_text(schema)
        if len(text) > MAX_SCHEMA_CHARS or text in seen:
            continue
        try:
            validator = make_validator(schema)
            valid = [t["data"] for t in case["tests"] if t["valid"] and validator.is_valid(t["data"])]
        except Exception:  # schemas jsonschema cannot compile are of no use for checking instances
            continue
        valid = [v for v in valid if len(instance_text(v)) <= MAX_INSTANCE_CHARS][:2]
        generated = [
            g for g in generate_instances(schema, rng, 2)
            if len(instance_text(g)) <= MAX_INSTANCE_CHARS and g not in valid
        ]
        if not valid and not generated:
            continue
        seen.add(text)
        name = path.stem
        by_subset.setdefault(subset_of(name), []).append(
            {"name": name, "subset": subset_of(name), "split": split_of(schema), "schema": schema,
             "valid": valid, "generated": generated}
        )
    rows = []
    for subset in sorted(by_subset):
        items = by_subset[subset]
        if len(items) > PER_SUBSET_CAP:
            items = sorted(random.Random(f"{SEED}:{subset}").sample(items, PER_SUBSET_CAP), key=lambda r: r["name"])
        rows.extend(items)
    return rows


def curate_gsm8k(gsm8k_dir: Path) -> list[dict]:
    rows = []
    with open(gsm8k_dir / "train.jsonl") as f:
        for line in f:
            item = json.loads(line)
            rows.append({"question": item["question"], "answer": item["answer"]})
            if len(rows) == GSM8K_ITEMS:
                break
    return rows


def write_jsonl_gz(path: Path, rows: list[dict]) -> None:
    # mtime=0 and a fixed filename field keep the compressed bytes reproducible.
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        for row in rows:
            gz.write((json.dumps(row, ensure_ascii=False, sort_keys=False) + "\n").encode())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", type=Path, default=Path("/work/shared/data"))
    args = parser.parse_args(argv)
    cases = curate_cases(args.shared / "jsonschemabench" / "cases")
    write_jsonl_gz(DATA_DIR / "jsonschemabench.jsonl.gz", cases)
    write_jsonl_gz(DATA_DIR / "gsm8k.jsonl.gz", curate_gsm8k(args.shared / "prompts" / "gsm8k"))
    heldout = sum(r["split"] == "heldout" for r in cases)
    print(f"{len(cases)} schemas ({heldout} held out), "
          f"{sum(len(r['valid']) for r in cases)} benchmark + {sum(len(r['generated']) for r in cases)} generated instances")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
