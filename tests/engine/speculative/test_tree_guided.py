"""Draft trees under grammars (engine/masking/grammar.py's tree fills): guided greedy and seeded outputs equal the
guided engine without speculation, with masks at expansion and verification or at verification only; every
finished output validates against its schema; expansion masks make the tree's nodes admissible, so it accepts
more than with verification masks alone."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams, SpecConfig, StructuredOutput

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


@pytest.fixture(scope="module")
def zoo(zoo_dir) -> Path:
    return Path(zoo_dir)


@pytest.fixture(scope="module")
def cases():
    from zoo.corpus import heldout_cases
    from zoo.prompts import json_schema_prompt

    rows = heldout_cases()[:6]
    return [json_schema_prompt(r["schema"]) for r in rows], [r["schema"] for r in rows]


def _params(schemas) -> list[SamplingParams]:
    """Greedy, and every third request sampled with a seed."""
    return [SamplingParams(max_tokens=160, temperature=0.8 if i % 3 == 1 else 0.0, seed=11 + i,
                           structured_output=StructuredOutput(json_schema=json.dumps(s)))
            for i, s in enumerate(schemas)]


@pytest.fixture(scope="module")
def reference(zoo, cases):
    prompts, schemas = cases
    llm = LLM(str(zoo / "target"), num_kv_blocks=2048, block_size=16)
    return [o.token_ids for o in llm.generate(prompts, _params(schemas))]


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_guided_tree_equals_guided_plain_and_validates(zoo, cases, reference, method):
    prompts, schemas = cases
    lengths = {}
    for draft_masks in (True, False):
        spec = SpecConfig(method=method, k=3, draft=str(zoo / method), topk=3, num_verify_tokens=8,
                          draft_masks=draft_masks)
        llm = LLM(str(zoo / "target"), num_kv_blocks=2048, block_size=16, speculative=spec)
        outs = llm.generate(prompts, _params(schemas))
        assert [o.token_ids for o in outs] == reference
        for o, schema in zip(outs, schemas):
            if o.finish_reason == "stop":
                jsonschema.validate(json.loads(o.text), schema)
        assert sum(o.finish_reason == "stop" for o in outs) >= len(outs) // 2
        lengths[draft_masks] = llm.engine.stats()["spec"]["mean_accepted_length"]
        assert llm.engine.blocks.pool.num_used == 0
    assert lengths[True] > lengths[False], lengths
