"""The zoo's trained heads (zoo/README.md) in the engine: lossless, and they actually predict.

The default zoo is the prebuilt one (zoo.testing's `zoo_dir`, nothing is built);
later sessions reuse the cache.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, SpecConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(zoo_dir) -> Path:
    """The default zoo, built once per machine by the session fixture (TANDEM_ZOO_DIR: one built elsewhere)."""
    return Path(zoo_dir)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


@pytest.fixture(scope="module")
def json_prompts():
    """Held-out schemas (never trained on), in the zoo's prompt template."""
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    return [json_schema_prompt(row["schema"]) for row in heldout_cases()[:6]]


@pytest.fixture(scope="module")
def reference(root, json_prompts):
    llm = LLM(str(root / "target"), num_kv_blocks=1024, block_size=16)
    return [o.token_ids for o in llm.generate(json_prompts, SamplingParams(max_tokens=48, temperature=0))]


@pytest.mark.parametrize("method,draft,min_mean", [("mtp", "mtp", 1.5), ("eagle3", "eagle3", 1.5),
                                                   ("draft_model", "draft", 1.5), ("ngram", None, 1.0)])
def test_zoo_heads_are_lossless_and_accepted(root, json_prompts, reference, method, draft, min_mean):
    spec = SpecConfig(method=method, k=3, draft=str(root / draft) if draft else None)
    llm = LLM(str(root / "target"), num_kv_blocks=1024, block_size=16, speculative=spec)
    outs = llm.generate(json_prompts, SamplingParams(max_tokens=48, temperature=0))
    assert [o.token_ids for o in outs] == reference
    mean = llm.engine.stats()["spec"]["mean_accepted_length"]
    assert mean >= min_mean, f"{method}: mean accepted length {mean:.2f} (random heads give about 1.0)"


def _trainer_drafts(kind: str, hf, head, tokens: list[int], k: int) -> list[int]:
    """Greedy drafts after `tokens` from the zoo's own head code (its training-time unrolled form):
    an independent implementation of the chain, run over the whole sequence."""
    from zoo.features import target_features

    aux = head.aux_layer_ids if kind == "eagle3" else None
    features = target_features(hf, torch.tensor([tokens[:-1]]), aux)
    hidden = head.first_hidden(features)
    nxt = torch.tensor([tokens[1:]])
    pos = torch.arange(len(tokens) - 1)[None]
    cache, drafts = [], []
    with torch.no_grad():
        for s in range(k):
            hidden, logits = head.step(hidden, nxt, pos + s, cache)
            best = head.to_target_vocab(logits).argmax(-1)  # [1, T]
            drafts.append(int(best[0, -1]))
            nxt = best
    return drafts


@pytest.mark.parametrize("kind", ["mtp", "eagle3"])
def test_engine_drafts_equal_the_zoo_trainers_heads(root, json_prompts, kind):
    from transformers import AutoModelForCausalLM

    from zoo.heads.eagle3 import Eagle3Head
    from zoo.heads.mtp import MTPHead

    hf = AutoModelForCausalLM.from_pretrained(str(root / "target")).eval()
    head = (MTPHead.load(root / "mtp") if kind == "mtp" else
            Eagle3Head.load(root / "eagle3", hf.get_input_embeddings())).eval()
    llm = LLM(str(root / "target"), num_kv_blocks=256, block_size=16,
              speculative=SpecConfig(method=kind, k=3, draft=str(root / kind)))
    engine = llm.engine
    engine.add_request("r", json_prompts[0], SamplingParams(max_tokens=24, temperature=0))
    req = engine.requests["r"]
    for _ in range(3):
        engine.step()
        assert req.spec_token_ids == _trainer_drafts(kind, hf, head, req.token_ids, 3)
