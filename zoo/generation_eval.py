"""What the target writes for held-out schema prompts, and how much speculation would accept of it.

- `unconstrained`: greedy completions; the share that parse as JSON, that satisfy their schema
  (jsonschema with format checks), and that degenerate (some token 4-gram occurs >= 4 times);
- `constrained`: greedy under the schema's grammar (xgrammar's transformers logits processor, with
  the compact separators the engine compiles JSON schemas with); the share that finish (emit eos)
  within the token budget and the share of those that satisfy the schema;
- `acceptance`: greedy speculative decoding at k drafts, simulated exactly on the target's own greedy
  output (for schema prompts, and for held-out GSM8K questions: natural text): a step at position i
  accepts the drafts that equal the following tokens, then moves past them and the bonus token. Heads
  draft from the target's features (the unrolled chain of zoo.distill.unroll, which sees the same
  tokens as drafting token by token while drafts match);
  ngram is engine.speculative.ngram's prompt lookup with the engine's default n range.
"""
from __future__ import annotations

import json
from collections import Counter

import torch

from zoo.distill import unroll
from zoo.features import target_features
from zoo.prompts import END, json_schema_prompt

DEGENERATE_NGRAM = 4
DEGENERATE_REPEATS = 4
NGRAM_MIN, NGRAM_MAX = 1, 4  # engine.config.SpecConfig's prompt_lookup_min/max defaults


def is_degenerate(tokens: list[int], n: int = DEGENERATE_NGRAM, repeats: int = DEGENERATE_REPEATS) -> bool:
    counts = Counter(tuple(tokens[i: i + n]) for i in range(len(tokens) - n + 1))
    return bool(counts) and max(counts.values()) >= repeats


def _validator(schema):
    try:
        from zoo.schema_gen import make_validator
    except ImportError:  # jsonschema is a dev dependency
        return None
    return make_validator(schema)


def _check(text: str, schema) -> tuple[bool, bool]:
    """-> (parses as JSON, satisfies the schema)."""
    try:
        instance = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False, False
    validator = _validator(schema)
    try:
        return True, validator is not None and validator.is_valid(instance)
    except Exception:  # a schema jsonschema cannot apply
        return True, False


@torch.no_grad()
def _greedy(target, ids: torch.Tensor, eos: int, max_new_tokens: int, processors=None) -> list[int]:
    out = target.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=eos, pad_token_id=eos, logits_processor=processors)
    return out[0, ids.shape[1]:].tolist()


def unconstrained(target, tokenizer, schemas: list[dict], max_new_tokens: int, samples: int = 4) -> dict:
    eos = tokenizer.token_to_id(END)
    parsed = valid = degenerate = finished = 0
    shown, outputs = [], []
    show_at = {i * len(schemas) // samples for i in range(samples)}  # spread over the subsets
    for index, row in enumerate(schemas):
        prompt = tokenizer.encode(json_schema_prompt(row["schema"])).ids
        tokens = _greedy(target, torch.tensor([prompt]), eos, max_new_tokens)
        body = tokens[:-1] if tokens and tokens[-1] == eos else tokens
        finished += int(len(body) < len(tokens))
        text = tokenizer.decode(body, skip_special_tokens=True)
        ok_json, ok_schema = _check(text, row["schema"])
        parsed, valid = parsed + ok_json, valid + ok_schema
        degenerate += int(is_degenerate(body))
        outputs.append((prompt, tokens))
        if index in show_at:
            shown.append({"schema": row["name"], "output": text[:300], "parses": ok_json, "valid": ok_schema})
    n = max(len(schemas), 1)
    return {"prompts": len(schemas), "max_new_tokens": max_new_tokens, "parses_as_json": round(parsed / n, 4),
            "satisfies_schema": round(valid / n, 4), "degenerate": round(degenerate / n, 4),
            "finished": round(finished / n, 4), "samples": shown, "_outputs": outputs}


def _hf_tokenizer(tokenizer_dir):
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))


def constrained(target, tokenizer, tokenizer_dir, schemas: list[dict], max_new_tokens: int, samples: int = 2) -> dict:
    import xgrammar as xgr
    from xgrammar.contrib.hf import LogitsProcessor

    eos = tokenizer.token_to_id(END)
    info = xgr.TokenizerInfo.from_huggingface(_hf_tokenizer(tokenizer_dir), vocab_size=target.config.vocab_size,
                                              stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    compiled_ok = finished = valid = 0
    shown, failures = [], []
    show_at = {i * len(schemas) // samples for i in range(samples)}
    for index, row in enumerate(schemas):
        try:
            grammar = compiler.compile_json_schema(json.dumps(row["schema"]), any_whitespace=False,
                                                   separators=(", ", ": "))
        except (RuntimeError, ValueError) as err:
            failures.append({"schema": row["name"], "error": str(err)[:120]})
            continue
        compiled_ok += 1
        prompt = torch.tensor([tokenizer.encode(json_schema_prompt(row["schema"])).ids])
        tokens = _greedy(target, prompt, eos, max_new_tokens, [LogitsProcessor(grammar)])
        done = bool(tokens) and tokens[-1] == eos
        text = tokenizer.decode(tokens[:-1] if done else tokens, skip_special_tokens=True)
        ok = done and _check(text, row["schema"])[1]
        finished, valid = finished + done, valid + ok
        if index in show_at:
            shown.append({"schema": row["name"], "output": text[:300], "finished": done, "valid": ok})
    n = max(compiled_ok, 1)
    return {"prompts": len(schemas), "compiled": compiled_ok, "max_new_tokens": max_new_tokens,
            "finished": round(finished / n, 4), "satisfies_schema": round(valid / n, 4),
            "samples": shown, "compile_failures": failures}


def plain_text(target, tokenizer, docs, max_new_tokens: int = 96, shown: int = 3) -> tuple[list[dict], list]:
    """Greedy answers to held-out GSM8K questions (documents "Question: ...\nAnswer: ..."): short plain
    text. -> (the first `shown` as samples, every (prompt ids, output ids) pair for `acceptance`)."""
    eos = tokenizer.token_to_id(END)
    samples, pairs = [], []
    for doc in docs:
        prompt = doc.text[: doc.text.index("Answer:") + len("Answer:")]
        ids = tokenizer.encode(prompt).ids
        tokens = _greedy(target, torch.tensor([ids]), eos, max_new_tokens)
        pairs.append((ids, tokens))
        if len(samples) < shown:
            question = prompt.split("Question: ", 1)[-1].rsplit("\nAnswer:", 1)[0]
            samples.append({"schema": "gsm8k", "prompt": " ".join(question.split())[:200],
                            "output": tokenizer.decode(tokens, skip_special_tokens=True)[:300]})
    return samples, pairs


def _leading_matches(guesses: list[int], following: list[int]) -> int:
    accepted = 0
    for guess, actual in zip(guesses, following):
        if guess != actual:
            break
        accepted += 1
    return accepted


@torch.no_grad()
def acceptance(target, heads: dict, outputs: list[tuple[list[int], list[int]]], k: int) -> dict:
    """Mean drafts accepted per step (0..k) by each head and by ngram over the target's greedy outputs.

    outputs: (prompt ids, greedy output ids) pairs from `unconstrained`.
    """
    from engine.speculative.ngram import propose_ngram

    aux_ids = heads["eagle3"].aux_layer_ids if "eagle3" in heads else None
    totals = {name: [0, 0] for name in (*heads, "ngram")}  # accepted drafts, steps
    for prompt, tokens in outputs:
        if len(tokens) < 2:
            continue
        ids = torch.tensor([prompt + tokens])
        features = target_features(target, ids, aux_ids)
        # guesses[name][s][i]: step s of the chain started at index i (predicting token i + 2 + s).
        guesses = {name: torch.stack([head.to_target_vocab(lg).argmax(-1)[0] for lg in unroll(head, features, ids, k)])
                   for name, head in heads.items()}
        sequence = ids[0].tolist()
        # The first output token comes from the prefill; each step then starts at the last accepted token.
        for name in totals:
            pos = len(prompt)  # index of the last token known to the target (the bonus of the step before)
            while pos < len(sequence) - 1:
                following = sequence[pos + 1: pos + 1 + k]
                if name == "ngram":
                    drafts = propose_ngram(sequence[: pos + 1], k, NGRAM_MIN, NGRAM_MAX)
                else:
                    drafts = guesses[name][:, pos - 1].tolist()
                accepted = _leading_matches(drafts, following)
                totals[name][0] += accepted
                totals[name][1] += 1
                pos += accepted + 1
    return {name: round(hit / max(steps, 1), 4) for name, (hit, steps) in totals.items()} | {
        "k": k, "steps": {name: steps for name, (_, steps) in totals.items()}}
