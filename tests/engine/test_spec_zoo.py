"""The zoo's trained heads (zoo/README.md) in the engine: lossless, and they actually predict.

Skipped, with the reason, when the zoo is not built: unit tests never build it (`make zoo` or
`tandem zoo build` does, in a few minutes; TANDEM_ZOO_DIR points at a zoo built elsewhere).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import LLM, SamplingParams, SpecConfig


def _zoo_root() -> Path | None:
    given = os.environ.get("TANDEM_ZOO_DIR")
    if given:
        return Path(given)
    import zoo

    return zoo.built_path()


ROOT = _zoo_root()
pytestmark = pytest.mark.skipif(ROOT is None, reason="the zoo is not built (run `make zoo`); its trained heads "
                                                      "are not tested in this session")


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
def reference(json_prompts):
    llm = LLM(str(ROOT / "target"), num_kv_blocks=1024, block_size=16)
    return [o.token_ids for o in llm.generate(json_prompts, SamplingParams(max_tokens=48, temperature=0))]


@pytest.mark.parametrize("method,draft,min_mean", [("mtp", "mtp", 1.5), ("eagle3", "eagle3", 1.5),
                                                   ("draft_model", "draft", 1.5), ("ngram", None, 1.0)])
def test_zoo_heads_are_lossless_and_accepted(json_prompts, reference, method, draft, min_mean):
    spec = SpecConfig(method=method, k=3, draft=str(ROOT / draft) if draft else None)
    llm = LLM(str(ROOT / "target"), num_kv_blocks=1024, block_size=16, speculative=spec)
    outs = llm.generate(json_prompts, SamplingParams(max_tokens=48, temperature=0))
    assert [o.token_ids for o in outs] == reference
    mean = llm.engine.stats()["spec"]["mean_accepted_length"]
    assert mean >= min_mean, f"{method}: mean accepted length {mean:.2f} (random heads give about 1.0)"
