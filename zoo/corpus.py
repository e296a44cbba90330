"""The zoo's corpus: JSON-Schema documents, Python code and plain text, split into train and held-out.

Sources (all local, read at build time):
- json: `zoo/data/jsonschemabench.jsonl.gz`, one document per (schema, instance) written with
  `zoo.prompts.json_schema_document`; the "heldout" schemas never reach training.
- code: the Python standard library's own top-level modules from this interpreter's install, cut
  into chunks at blank lines; one module in ten (by a hash of its name) is held out.
- text: GSM8K problems with their worked answers (`zoo/data/gsm8k.jsonl.gz`, the last 10% held out)
  and the longer docstrings of the training modules.

`corpus_fingerprint()` hashes every input byte, so the build cache notices a different stdlib.
"""
from __future__ import annotations

import ast
import gzip
import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from zoo.prompts import BOS, END, json_schema_document

DATA_DIR = Path(__file__).parent / "data"
CASES_FILE = DATA_DIR / "jsonschemabench.jsonl.gz"
GSM8K_FILE = DATA_DIR / "gsm8k.jsonl.gz"
CODE_CHUNK_CHARS = 1400
MAX_MODULE_BYTES = 120_000
MIN_DOCSTRING_CHARS = 240


@dataclass(frozen=True, slots=True)
class Document:
    domain: str  # "json" | "code" | "text"
    text: str  # complete text, starting with <|bos|>
    prompt_chars: int = 0  # json: length of the prompt prefix (the rest is the instance + <|end|>)


@dataclass(frozen=True, slots=True)
class Corpus:
    train: tuple[Document, ...]
    heldout: tuple[Document, ...]
    heldout_schemas: tuple[dict, ...]  # rows of jsonschemabench.jsonl.gz with split == "heldout"


def load_cases() -> list[dict]:
    with gzip.open(CASES_FILE, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def heldout_cases() -> list[dict]:
    """The held-out schema rows (for eval and benchmarks): never trained on."""
    return [row for row in load_cases() if row["split"] == "heldout"]


def _json_docs(rows: list[dict], with_generated: bool) -> list[Document]:
    docs = []
    for row in rows:
        instances = row["valid"] + (row["generated"] if with_generated else [])
        for instance in instances:
            text = json_schema_document(row["schema"], instance)
            prompt_chars = len(text) - len(json.dumps(instance, ensure_ascii=False)) - len(END)
            docs.append(Document("json", text, prompt_chars))
    return docs


def _stdlib_modules(max_modules: int) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(stdlib.glob("*.py")) if p.stat().st_size <= MAX_MODULE_BYTES]
    return files[:max_modules]


def _is_heldout(name: str, percent: int) -> bool:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") % 100 < percent


def _code_chunks(source: str) -> list[str]:
    chunks, current = [], ""
    for block in source.split("\n\n"):
        if current and len(current) + len(block) > CODE_CHUNK_CHARS:
            chunks.append(current)
            current = ""
        current += block + "\n\n"
    if current.strip():
        chunks.append(current)
    return chunks


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= MIN_DOCSTRING_CHARS:
                found.append(doc)
    return found


def _gsm8k() -> list[dict]:
    with gzip.open(GSM8K_FILE, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def build_corpus(max_modules: int, heldout_percent: int = 10) -> Corpus:
    """All documents, split; a pure function of the data files, the stdlib and the arguments."""
    rows = load_cases()
    train = _json_docs([r for r in rows if r["split"] == "train"], with_generated=True)
    heldout_rows = [r for r in rows if r["split"] == "heldout"]
    heldout = _json_docs(heldout_rows, with_generated=False)
    for path in _stdlib_modules(max_modules):
        source = path.read_text(encoding="utf-8", errors="replace")
        target = heldout if _is_heldout(path.name, heldout_percent) else train
        target.extend(Document("code", BOS + chunk) for chunk in _code_chunks(source))
        if target is train:
            train.extend(Document("text", BOS + doc + END) for doc in _docstrings(source))
    problems = _gsm8k()
    cut = len(problems) - len(problems) * heldout_percent // 100
    for i, item in enumerate(problems):
        doc = Document("text", f"{BOS}Question: {item['question']}\nAnswer: {item['answer']}{END}")
        (train if i < cut else heldout).append(doc)
    return Corpus(tuple(train), tuple(heldout), tuple(heldout_rows))


def generated_json_docs(per_schema: int, seed: int) -> list[Document]:
    """`per_schema` more instances of every TRAINING schema drawn by zoo.schema_gen, as documents.

    Each schema's draws use their own rng, seeded by (seed, schema name), so the result does not
    depend on the order of the rows; instances already in the curated data are skipped.
    """
    from zoo.schema_gen import generate_instances

    if per_schema <= 0:
        return []
    rows = []
    for row in load_cases():
        if row["split"] != "train":
            continue
        known = row["valid"] + row["generated"]
        drawn = generate_instances(row["schema"], random.Random(f"{seed}:{row['name']}"), per_schema)
        rows.append(dict(row, valid=[x for x in drawn if x not in known], generated=[]))
    return _json_docs(rows, with_generated=False)


def corpus_fingerprint(max_modules: int) -> str:
    """sha256 over every input the corpus reads (data files and the chosen stdlib modules)."""
    digest = hashlib.sha256()
    for path in (CASES_FILE, GSM8K_FILE, *_stdlib_modules(max_modules)):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
