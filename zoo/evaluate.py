"""Evaluates a built zoo on text it never trained on.

- target loss: mean next-token NLL per domain on the held-out corpus (json = held-out schemas with the
  benchmark's valid instances; code = held-out stdlib modules; text = held-out GSM8K), plus the loss
  on the JSON instance tokens alone (the part a structured-output request generates);
- head agreement: for MTP and EAGLE-3, teacher-forced top-1 agreement with the target at depths
  1..3 on held-out JSON documents, scored on the instance positions (where speculation runs) and on
  all positions; the draft model's next-token agreement with the target on the same positions; and
  depth-1 agreement on the instance positions by the target's confidence there (its top-1
  probability), which says how much of the agreement the target's own certainty allows;
- generation (zoo.generation_eval): greedy completions of held-out schema prompts, unconstrained
  (parse, validate and degeneration rates) and under the schema's grammar (finish rate), and the
  drafts MTP, EAGLE-3 and ngram prompt lookup would get accepted at k drafts on those outputs.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from zoo import generation_eval, layout
from zoo.corpus import build_corpus
from zoo.distill import head_agreement, shift_left, unroll
from zoo.features import target_features
from zoo.heads.eagle3 import Eagle3Head
from zoo.heads.mtp import MTPHead
from zoo.prompts import BOS
from zoo.tokenizer import load_tokenizer


def spread(items: list, n: int) -> list:
    """n items evenly spaced over the list (held-out files are sorted by subset; this mixes them)."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def load_models(root: Path):
    paths = layout(root)
    target = AutoModelForCausalLM.from_pretrained(paths.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(paths.draft, dtype=torch.float32).eval()
    mtp = MTPHead.load(paths.mtp).eval()
    eagle3 = Eagle3Head.load(paths.eagle3, target.get_input_embeddings()).eval()
    return target, draft, mtp, eagle3


@torch.no_grad()
def domain_losses(target, tokenizer, docs) -> dict[str, float]:
    sums: dict[str, list[float]] = {}
    for doc in docs:
        ids = torch.tensor([tokenizer.encode(doc.text).ids])
        logits = target(input_ids=ids, use_cache=False).logits[0, :-1]
        nll = F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum").item()
        total = sums.setdefault(doc.domain, [0.0, 0])
        total[0] += nll
        total[1] += ids.shape[1] - 1
        if doc.domain == "json":
            start = len(tokenizer.encode(doc.text[: doc.prompt_chars]).ids) - 1
            part = F.cross_entropy(logits[start:].float(), ids[0, start + 1:], reduction="sum").item()
            total = sums.setdefault("json_instance", [0.0, 0])
            total[0] += part
            total[1] += ids.shape[1] - 1 - start
    return {name: round(s / max(n, 1), 4) for name, (s, n) in sums.items()}


# Bands of the target's top-1 probability at the position it predicts: [0, 0.5), [0.5, 0.9), [0.9, 1].
CONFIDENCE_BANDS = (0.0, 0.5, 0.9)


def _by_band(hit: torch.Tensor, valid: torch.Tensor, confidence: torch.Tensor, counts: list[list[int]]) -> None:
    """Adds (hits, positions) per confidence band to `counts`."""
    edges = (*CONFIDENCE_BANDS, float("inf"))
    for band, (lo, hi) in enumerate(zip(edges, edges[1:])):
        mask = valid & (confidence >= lo) & (confidence < hi)
        counts[band][0] += int((hit & mask).sum())
        counts[band][1] += int(mask.sum())


@torch.no_grad()
def agreement(target, draft, heads, tokenizer, docs, depth: int) -> dict:
    aux_ids = heads["eagle3"].aux_layer_ids if "eagle3" in heads else None
    counts = {f"{name}/{scope}": [[0, 0] for _ in range(depth)] for name in heads for scope in ("instance", "all")}
    counts.update({f"draft/{scope}": [[0, 0]] for scope in ("instance", "all")})
    bands = {name: [[0, 0] for _ in CONFIDENCE_BANDS] for name in (*heads, "draft")}
    for doc in docs:
        ids = torch.tensor([tokenizer.encode(doc.text).ids])
        n = ids.shape[1]
        real = torch.ones_like(ids, dtype=torch.bool)
        start = len(tokenizer.encode(doc.text[: doc.prompt_chars]).ids) - 1
        instance = torch.zeros_like(real)
        instance[0, start: n - 1] = True
        everything = torch.zeros_like(real)
        everything[0, : n - 1] = True
        features = target_features(target, ids, aux_ids)
        target_top = features["logits"].argmax(-1)
        confidence = features["logits"].float().softmax(-1).amax(-1)  # [1, n]
        draft_top = draft(input_ids=ids, use_cache=False).logits.argmax(-1)
        _by_band(draft_top == target_top, instance, confidence, bands["draft"])
        for name, head in heads.items():  # depth 1: index i predicts what the target predicts at i + 1
            guess = head.to_target_vocab(unroll(head, features, ids, 1)[0]).argmax(-1)
            _by_band(guess == shift_left(target_top, 1, -1), shift_left(instance, 1, False),
                     shift_left(confidence, 1, 0.0), bands[name])
        for scope, mask in (("instance", instance), ("all", everything)):
            for name, head in heads.items():
                for d, (hit, count) in enumerate(head_agreement(head, features, ids, real, depth, mask)):
                    counts[f"{name}/{scope}"][d][0] += hit
                    counts[f"{name}/{scope}"][d][1] += count
            counts[f"draft/{scope}"][0][0] += int(((draft_top == target_top) & mask).sum())
            counts[f"draft/{scope}"][0][1] += int(mask.sum())
    return {key: [round(h / max(c, 1), 4) for h, c in value] for key, value in counts.items()} | {
        "positions": {key: [c for _, c in value] for key, value in counts.items()},
        "by_confidence": {"bands": list(CONFIDENCE_BANDS), "positions": [c for _, c in bands["draft"]],
                          **{name: [round(h / max(c, 1), 4) for h, c in value] for name, value in bands.items()}}}


def evaluate_zoo(root: Path, max_docs: int = 120, depth: int = 3, gen_prompts: int = 64,
                 max_new_tokens: int = 256, k: int = 3, baseline: dict | None = None, text_prompts: int = 32) -> dict:
    """Everything above on held-out data; `baseline` (an earlier result) is carried along for the report."""
    started = time.perf_counter()
    manifest = json.loads(layout(root).manifest.read_text())
    tokenizer = load_tokenizer(layout(root).tokenizer)
    target, draft, mtp, eagle3 = load_models(root)
    corpus = build_corpus(manifest["recipe"]["stdlib_modules"])
    by_domain: dict[str, list] = {}
    for doc in corpus.heldout:
        by_domain.setdefault(doc.domain, []).append(doc)
    picked = [d for docs in by_domain.values() for d in spread(docs, max_docs)]
    json_docs = spread(by_domain.get("json", []), max_docs)
    losses = domain_losses(target, tokenizer, picked)
    agree = agreement(target, draft, {"mtp": mtp, "eagle3": eagle3}, tokenizer, json_docs, depth)
    schemas = spread(list(corpus.heldout_schemas), gen_prompts)
    free = generation_eval.unconstrained(target, tokenizer, schemas, max_new_tokens)
    outputs = free.pop("_outputs")
    accept = generation_eval.acceptance(target, {"mtp": mtp, "eagle3": eagle3}, outputs, k)
    grammar = generation_eval.constrained(target, tokenizer, layout(root).tokenizer, schemas, max_new_tokens)
    questions = [d for d in by_domain.get("text", []) if d.text.startswith(BOS + "Question: ")]
    free["text_samples"], text_outputs = generation_eval.plain_text(target, tokenizer, spread(questions, text_prompts))
    accept_text = generation_eval.acceptance(target, {"mtp": mtp, "eagle3": eagle3}, text_outputs, k) | {
        "prompts": len(text_outputs)}
    return {
        "zoo": str(root),
        "recipe": manifest["recipe"]["name"],
        "seed": manifest["recipe"]["seed"],
        "target_parameters": manifest["target_parameters"],
        "target_loss": losses,
        "target_perplexity": {k: round(math.exp(v), 2) for k, v in losses.items()},
        "agreement": agree,
        "generation": free,
        "constrained": grammar,
        "acceptance": accept,
        "acceptance_text": accept_text,
        "baseline": baseline and {key: baseline.get(key) for key in (
            "recipe", "target_parameters", "target_loss", "agreement", "generation", "constrained", "acceptance",
            "acceptance_text", "build")},
        "heldout_docs": {k: min(len(v), max_docs) for k, v in by_domain.items()},
        "build": {key: manifest.get(key) for key in ("build_seconds", "peak_rss_mb", "target_parameters", "draft_parameters")},
        "eval_seconds": round(time.perf_counter() - started, 1),
    }
