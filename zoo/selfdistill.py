"""Self-distilled training data for a real target's draft heads: the target's own answers to real prompts.

A draft head is accepted when it predicts what the TARGET would write, so it trains on the target's own
responses (greedy and sampled, through the engine, in the target's chat template), not on reference
answers. Prompts come from the public evaluation data in `../shared/data` (see its README):

- GSM8K train questions (math word problems, chain-of-thought answers),
- Vicuna-bench questions (open chat),
- HumanEval prompts (code completion),
- JSONSchemaBench schemas: "answer with a JSON object for this schema", half of them generated under the
  schema's grammar (what guided requests look like to the head), half unguided;
- chat queries the target writes itself (`synthesize_queries`, the Magpie method: an instruct model continued
  from its chat template's opening of a user turn writes a user's message). The public sets hold only 80 open
  chat questions, and open chat is where the heads agreed least with the target.

Held aside for evaluation (never trained on): MT-Bench questions, GSM8K test, json-mode-eval, and every
HumanEval task whose number is a multiple of 4. `prompt_set` is deterministic for a seed.

Output: JSON lines {"key", "source", "guided", "temperature", "prompt_ids", "output_ids"} appended as
batches finish, so an interrupted run resumes where it stopped (`generate` skips keys already written).
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MAX_SCHEMA_CHARS = 1500  # longer schemas make prompts the engine spends most of its time prefilling
SCHEMA_INSTRUCTION = "Reply with a JSON object that satisfies this JSON Schema. Reply with the JSON only.\n\n"


@dataclass(frozen=True, slots=True)
class Prompt:
    key: str
    source: str
    messages: tuple[dict, ...]
    schema: dict | None = None  # a JSON-schema prompt; generated under its grammar when `guided`
    guided: bool = False
    temperature: float = 0.0


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def schema_prompt(schema: dict) -> tuple[dict, ...]:
    return _user(SCHEMA_INSTRUCTION + json.dumps(schema, indent=1))


def humaneval_prompt(code: str) -> tuple[dict, ...]:
    return _user("Complete this Python function. Reply with the whole function in a code block.\n\n"
                 f"```python\n{code.rstrip()}\n```")


def prompt_set(data_dir: Path, *, gsm8k: int = 1200, schemas: int = 900, seed: int = 0,
               sampled_fraction: float = 0.3) -> list[Prompt]:
    """The training prompts, shuffled; a `sampled_fraction` of the unguided ones sample at temperature 0.7."""
    data_dir = Path(data_dir)
    rng = random.Random(seed)
    prompts: list[Prompt] = []
    for i, row in enumerate(_jsonl(data_dir / "prompts/gsm8k/train.jsonl")[:gsm8k]):
        prompts.append(Prompt(f"gsm8k-train-{i}", "gsm8k", _user(row["question"])))
    for row in _jsonl(data_dir / "prompts/mt-bench/vicuna_bench/question.jsonl"):
        prompts.append(Prompt(f"vicuna-{row['question_id']}", "vicuna", _user(row["turns"][0])))
    for row in _jsonl(data_dir / "prompts/humaneval/HumanEval.jsonl"):
        number = int(row["task_id"].split("/")[1])
        if number % 4:
            prompts.append(Prompt(f"humaneval-{number}", "humaneval", humaneval_prompt(row["prompt"])))
    cases = sorted((data_dir / "jsonschemabench/cases").glob("*.json"))
    rng.shuffle(cases)
    taken = 0
    for path in cases:
        if taken >= schemas:
            break
        schema = json.loads(path.read_text(encoding="utf-8")).get("schema")
        if not isinstance(schema, dict) or len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
            continue
        guided = taken % 2 == 0
        prompts.append(Prompt(f"schema-{path.stem}", "jsonschemabench", schema_prompt(schema), schema, guided))
        taken += 1
    out = []
    for p in prompts:
        sampled = not p.guided and rng.random() < sampled_fraction
        out.append(Prompt(p.key, p.source, p.messages, p.schema, p.guided, 0.7 if sampled else 0.0))
    rng.shuffle(out)
    return out


def heldout_set(data_dir: Path, per_source: int = 16) -> list[Prompt]:
    """Prompts no head trains on, for agreement and acceptance: MT-Bench first turns, GSM8K test questions,
    the held-aside HumanEval tasks (numbers divisible by 4) and json-mode-eval schemas (guided)."""
    data_dir = Path(data_dir)
    out = [Prompt(f"mt-bench-{r['question_id']}", "mt-bench", _user(r["turns"][0]))
           for r in _jsonl(data_dir / "prompts/mt-bench/question.jsonl")[:per_source]]
    out += [Prompt(f"gsm8k-test-{i}", "gsm8k-test", _user(r["question"]))
            for i, r in enumerate(_jsonl(data_dir / "prompts/gsm8k/test.jsonl")[:per_source])]
    code = [r for r in _jsonl(data_dir / "prompts/humaneval/HumanEval.jsonl") if int(r["task_id"].split("/")[1]) % 4 == 0]
    out += [Prompt(f"humaneval-{r['task_id'].split('/')[1]}", "humaneval-heldout", humaneval_prompt(r["prompt"]))
            for r in code[:per_source]]
    items = sorted((data_dir / "json-mode-eval/items").glob("*.json"), key=lambda p: int(p.stem.split("_")[1]))
    for path in items[:per_source]:
        schema = json.loads(path.read_text(encoding="utf-8"))["schema"]
        out.append(Prompt(f"jme-{path.stem}", "json-mode-eval", schema_prompt(schema), schema, True))
    return out


def chat_ids(tokenizer, messages) -> list[int]:
    """The prompt ids of `messages` in the tokenizer's chat template, ready for the assistant's answer
    (transformers returns a list or, in newer releases, an encoding holding one)."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def done_keys(path: Path) -> set[str]:
    if not path.is_file():
        return set()
    keys = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            keys.add(json.loads(line)["key"])
        except (json.JSONDecodeError, KeyError):
            continue  # a line cut by an interrupted write: that prompt runs again
    return keys


QUERY_SENTINEL = "\x00TANDEM-QUERY\x00"


def query_prefix(tokenizer) -> str:
    """The chat template's text up to where a user's message starts (its system turn, if the template adds
    one, then the user turn's opening), found by rendering a sentinel message and cutting at it."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUERY_SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if QUERY_SENTINEL not in text:
        raise ValueError("the chat template does not render the user's message verbatim; no query prefix")
    return text.split(QUERY_SENTINEL)[0]


def usable_query(text: str, finish_reason: str | None) -> str | None:
    """A synthesized query worth answering: finished by the model (not cut at max_tokens), 16-800 characters,
    no chat-template markup leaking into it."""
    text = text.strip()
    if finish_reason != "stop" or not 16 <= len(text) <= 800 or "<|" in text or "im_start" in text:
        return None
    return text


def synthesize_queries(llm, path: Path, count: int, *, seed: int = 0, max_tokens: int = 96,
                       temperature: float = 1.0, top_p: float = 0.95, max_attempts: int | None = None) -> list[str]:
    """`count` distinct chat queries written by the target (Magpie), cached as JSON lines in `path` (one per
    attempt, `query` null when unusable) so a stopped run resumes; each attempt has its own seed, so the set
    is deterministic for `seed`. Fewer come back when `max_attempts` (default 8 per query) yield no more."""
    from engine import SamplingParams

    attempts: dict[int, str | None] = {}
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
                attempts[int(rec["attempt"])] = rec["query"]
            except (json.JSONDecodeError, KeyError, ValueError):
                continue
    prefix = llm.tokenizer.encode(query_prefix(llm.tokenizer), add_special_tokens=False)

    def distinct() -> list[str]:
        seen, out = set(), []
        for i in sorted(attempts):
            q = attempts[i]
            if q and q.lower() not in seen:
                seen.add(q.lower())
                out.append(q)
        return out

    queries = distinct()
    max_attempts = 8 * count if max_attempts is None else max_attempts
    while len(queries) < count and len(attempts) < max_attempts:
        start = max(attempts, default=-1) + 1
        n = max(16, min(256, 2 * (count - len(queries))))
        params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                 seed=seed * 1_000_003 + start + i) for i in range(n)]
        outs = llm.generate([prefix] * n, params)
        with path.open("a", encoding="utf-8") as f:
            for i, o in enumerate(outs):
                attempts[start + i] = usable_query(o.text, o.finish_reason)
                f.write(json.dumps({"attempt": start + i, "query": attempts[start + i]}) + "\n")
        queries = distinct()
        log.info("%d distinct queries after %d attempts", len(queries), len(attempts))
    if len(queries) < count:
        log.warning("only %d of %d queries usable after %d attempts", len(queries), count, len(attempts))
    return queries[:count]


def query_prompts(queries: list[str], *, seed: int = 0, sampled_fraction: float = 0.3) -> list[Prompt]:
    """Synthesized queries as training prompts, keyed by their text (a resumed run skips answered ones)."""
    rng = random.Random(seed + 1)
    return [Prompt("chat-" + hashlib.sha256(q.encode()).hexdigest()[:16], "chat", _user(q),
                   temperature=0.7 if rng.random() < sampled_fraction else 0.0) for q in queries]


def open_target(model: str, *, batch: int = 32, dtype: str | None = None, cpu_compile: str = "off"):
    from engine import LLM

    return LLM(model, dtype=dtype, max_num_seqs=batch, kv_cache_memory_gb=4.0, max_num_batched_tokens=4096,
               cpu_compile=cpu_compile)


def generate(model, prompts: list[Prompt], out: Path, *, max_tokens: int = 384, batch: int = 32,
             seed: int = 0, dtype: str | None = None, cpu_compile: str = "off") -> int:
    """Answer every prompt not yet in `out` with the engine (`model`: a path, or an open engine.LLM);
    -> how many were written in this call."""
    from engine import SamplingParams, StructuredOutput

    out.parent.mkdir(parents=True, exist_ok=True)
    done = done_keys(out)  # once: read per prompt, it parsed the whole file thousands of times (minutes)
    todo = [p for p in prompts if p.key not in done]
    log.info("%d of %d prompts to answer", len(todo), len(prompts))
    llm = model if hasattr(model, "generate") else open_target(model, batch=batch, dtype=dtype, cpu_compile=cpu_compile)
    tok = llm.tokenizer
    written = 0
    # Four batches per call: the engine's continuous batching refills a finished request's row from the same
    # call, so rows stay busy until the call's tail (one batch per call idled ~half the rows waiting for its
    # longest answer); appending after each call keeps an interrupted run's loss to one call.
    per_call = 4 * batch
    for start in range(0, len(todo), per_call):
        chunk, ids, params = [], [], []
        for n, p in enumerate(todo[start:start + per_call]):
            prompt_ids = chat_ids(tok, p.messages)
            guide = StructuredOutput(json_schema=p.schema) if p.guided else None
            sp = SamplingParams(max_tokens=max_tokens, temperature=p.temperature, seed=seed + start + n,
                                structured_output=guide)
            chunk.append(p)
            ids.append(prompt_ids)
            params.append(sp)
        outputs = _generate_tolerant(llm, ids, params)
        with out.open("a", encoding="utf-8") as f:
            for p, prompt_ids, o in zip(chunk, ids, outputs):
                if o is None:
                    continue
                f.write(json.dumps({"key": p.key, "source": p.source, "guided": p.guided and o[1],
                                    "temperature": p.temperature, "prompt_ids": prompt_ids,
                                    "output_ids": o[0]}) + "\n")
                written += 1
        log.info("%d/%d answered", start + len(chunk), len(todo))
    return written


def _generate_tolerant(llm, ids: list[list[int]], params: list) -> list[tuple[list[int], bool] | None]:
    """Generate a batch through the engine's continuous batching; -> (output ids, guided) per prompt, None
    where the engine refused the prompt outright. A request whose grammar the backends refuse (reported on
    its own output, the others running on) is queued again without its grammar, alone."""
    from dataclasses import replace

    from engine import TandemError

    engine, results = llm.engine, [None] * len(ids)
    live: dict[str, tuple[int, bool]] = {}  # request id -> (prompt index, guided)

    def submit(i: int, sp) -> None:
        rid = f"selfdistill-{llm._next_id}"
        llm._next_id += 1
        try:
            engine.add_request(rid, ids[i], sp)
        except TandemError:
            if sp.structured_output is None:
                return  # refused even unguided: leave it out
            return submit(i, replace(sp, structured_output=None))
        live[rid] = (i, sp.structured_output is not None)

    for i, sp in enumerate(params):
        submit(i, sp)
    while live:
        for out in engine.step():
            if out.request_id not in live or not (out.finished or out.error is not None):
                continue
            i, guided = live.pop(out.request_id)
            if out.error is not None:
                if guided:
                    submit(i, replace(params[i], structured_output=None))
                continue
            results[i] = (list(out.token_ids), guided)
    return results


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m zoo.selfdistill", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="target: an HF directory or a .gguf file")
    ap.add_argument("--data", default="../shared/data", help="the public evaluation data folder")
    ap.add_argument("--out", required=True, help="JSON lines file (appended; resumes)")
    ap.add_argument("--gsm8k", type=int, default=1200)
    ap.add_argument("--schemas", type=int, default=900)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shard", default="0/1", help="i/n: answer every n-th prompt from the i-th (one process each)")
    ap.add_argument("--cpu-compile", default="full", choices=("off", "gemm", "layers", "full"),
                    help="the engine's CPU compilation (full: batch-16 decode ran 1.4x layers on SmolLM2)")
    ap.add_argument("--heldout", type=int, default=0, help="answer N held-aside prompts per source instead (evaluation)")
    ap.add_argument("--chat", type=int, default=0,
                    help="also answer N chat queries the target writes itself (cached in OUT.queries.jsonl)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.heldout:
        prompts = heldout_set(Path(args.data), args.heldout)
    else:
        prompts = prompt_set(Path(args.data), gsm8k=args.gsm8k, schemas=args.schemas, seed=args.seed)
    index, count = (int(x) for x in args.shard.split("/"))
    llm = open_target(args.model, batch=args.batch, cpu_compile=args.cpu_compile)
    if args.chat and not args.heldout:
        out = Path(args.out)
        # Shards would write one query cache at once: with --shard, the queries must be synthesized beforehand
        # (one process, --shard 0/1), and each shard then only reads them.
        queries = synthesize_queries(llm, out.with_name(out.name + ".queries.jsonl"), args.chat, seed=args.seed,
                                     max_attempts=None if count == 1 else 0)
        if len(queries) < args.chat and count > 1:
            raise SystemExit(f"--chat {args.chat} with --shard {args.shard}: the query cache holds {len(queries)}; "
                             "synthesize them first with one process (--shard 0/1)")
        prompts = query_prompts(queries, seed=args.seed) + prompts
    prompts = prompts[index::count]
    generate(llm, prompts, Path(args.out), max_tokens=args.max_tokens, batch=args.batch, seed=args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
