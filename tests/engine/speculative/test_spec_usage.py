"""Per-request speculation counts (RequestOutput.speculative, engine/outputs.py's SpecUsage): they add up to
the output (1 + accepted + verify steps tokens when nothing stops early), accepted never exceeds drafted, a
draft network that is the target accepts everything, and forced drafts are counted for guided requests
only (all drafts of the `grammar` method, none with forced drafts off)."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams, SpecConfig, StructuredOutput
from engine.outputs import SpecUsage
from tests.support.spec import greedy_params, random_prompts, spec_config

K = 3
# Keys a grammar forces whole (quotes, colons, braces and the names themselves): forced runs of several tokens.
SCHEMA = {"type": "object", "properties": {"identifier": {"type": "string", "maxLength": 6},
                                           "temperature_celsius": {"type": "integer"},
                                           "status": {"enum": ["active", "inactive"]}},
          "required": ["identifier", "temperature_celsius", "status"], "additionalProperties": False}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


@pytest.mark.parametrize("method", ["mtp", "eagle3", "ngram", "draft_model", "self_draft"])
def test_counts_add_up_to_the_output(llama_dir, spec_drafts, method):
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4, speculative=spec_config(method, K, spec_drafts, llama_dir))
    outs = llm.generate(random_prompts(4, seed=3), greedy_params(max_tokens=17))
    for o in outs:
        u = o.speculative
        assert isinstance(u, SpecUsage) and u.method == ("draft_model" if method == "self_draft" else method)
        assert len(o.token_ids) == 17 == 1 + u.accepted_tokens + u.verify_steps  # ignore_eos: nothing stops early
        assert 0 <= u.accepted_tokens <= u.draft_tokens <= K * u.verify_steps
        assert u.forced_tokens == 0  # no grammar
        assert u.acceptance_length == (u.accepted_tokens + u.verify_steps) / u.verify_steps
        assert u.verify_steps == len(o.metrics.accepted_lengths) and u.accepted_tokens == o.metrics.num_accepted_tokens
        if method == "self_draft":  # the target drafting for itself: every draft accepted
            assert u.accepted_tokens == u.draft_tokens > 0
    total = sum((o.speculative for o in outs[1:]), outs[0].speculative)
    assert total.body()["draft_tokens"] == sum(o.speculative.draft_tokens for o in outs)


def test_no_speculation_reports_none(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=128, block_size=4)
    assert all(o.speculative is None for o in llm.generate(random_prompts(2), greedy_params(max_tokens=5)))


def test_a_single_token_output_ran_no_decoding_step(llama_dir, spec_drafts):
    llm = LLM(llama_dir, num_kv_blocks=128, block_size=4, speculative=spec_config("mtp", K, spec_drafts, llama_dir))
    assert [o.speculative for o in llm.generate(random_prompts(2), greedy_params(max_tokens=1))] == [None, None]


def _guided_run(zoo_dir, method: str, forced: bool):
    """Two guided requests and an unguided one in one batch on the zoo's trained target."""
    from zoo.prompts import json_schema_prompt

    draft = {"mtp": "mtp", "eagle3": "eagle3"}.get(method)
    spec = SpecConfig(method=method, k=K, draft=str(Path(zoo_dir) / draft) if draft else None, forced_drafts=forced)
    llm = LLM(str(Path(zoo_dir) / "target"), num_kv_blocks=512, block_size=16, speculative=spec)
    llm.engine.guided.compiler().compile_timeout_s = None  # a shared 2-core machine: no compile deadline
    guided = SamplingParams(max_tokens=40, temperature=0, structured_output=StructuredOutput(json_schema=SCHEMA))
    prompt = json_schema_prompt(SCHEMA)
    return llm.generate([prompt, prompt, "Tell me about the weather."],
                        [guided, guided, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)])


@pytest.mark.parametrize("method", ["mtp", "ngram", "grammar"])
def test_forced_drafts_counted_for_guided_requests_only(zoo_dir, method):
    outs = _guided_run(zoo_dir, method, forced=True)
    *guided, free = outs
    for o in guided:
        u = o.speculative
        assert 0 < u.forced_tokens <= u.draft_tokens and u.accepted_tokens <= u.draft_tokens
        # a grammar that completes ends the output inside a step: never more tokens than the counts allow
        assert len(o.token_ids) <= 1 + u.accepted_tokens + u.verify_steps
        if method == "grammar":  # it drafts nothing but forced tokens
            assert u.forced_tokens == u.draft_tokens
    assert free.speculative.forced_tokens == 0
    assert len(free.token_ids) == 1 + free.speculative.accepted_tokens + free.speculative.verify_steps
    if method == "grammar":
        assert free.speculative.draft_tokens == 0  # plain steps, still counted as steps
    off = _guided_run(zoo_dir, method, forced=False)
    assert [o.token_ids for o in off] == [o.token_ids for o in outs]  # forced drafts are drafts: lossless
    assert all(o.speculative.forced_tokens == 0 for o in off)
