"""Continuation (engine/core/request.py, engine/intake.py): a request started again after the output it had
produced elsewhere goes on exactly as the uninterrupted run: greedy, seeded sampling, unseeded sampling given the
seed the first run drew, a JSON-schema grammar (replayed through the emitted tokens), logprobs, and speculation
(MTP on the zoo's trained head). This is what the router's resumption after a worker's death relies on
(router/generation.py); the served kill tests are tests/router/test_resumption.py."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, Continuation, InvalidRequestError, SamplingParams, SpecConfig, StructuredOutput

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}, "tags": {"type": "array",
                                                                                "items": {"type": "string"}}},
          "required": ["name", "age", "tags"]}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def _run(llm: LLM, rid: str, prompt, params: SamplingParams, continuation: Continuation | None = None):
    """-> (the request's outputs, step by step; the seed it ran with)."""
    eng = llm.engine
    eng.add_request(rid, prompt, params, continuation=continuation)
    seed = eng.requests[rid].seed  # drawn by the engine when the request brings none
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs, seed


def _resume(llm: LLM, prompt, params: SamplingParams, full, seed: int, cut: int):
    """The same request started again after `full`'s first `cut` output tokens: -> its outputs."""
    logprobs = tuple((lp.token_id, lp.logprob, lp.top) for lp in full.logprobs[:cut]) if full.logprobs else ()
    return _run(llm, f"resumed-{cut}", prompt, params, Continuation(tuple(full.token_ids[:cut]), seed, logprobs))[0]


@pytest.mark.parametrize("kind", ["greedy", "seeded", "unseeded"])
def test_a_continuation_goes_on_as_the_uninterrupted_run(llama_dir, kind):
    llm = LLM(llama_dir, num_kv_blocks=128, block_size=4)
    prompt = [5, 9, 22, 41, 8, 120, 7]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0 if kind == "greedy" else 0.9,
                            seed=7 if kind == "seeded" else None, logprobs=2)
    outs, seed = _run(llm, "full", prompt, params)
    full = outs[-1]
    for cut in (1, 9, 23):
        outs = _resume(llm, prompt, params, full, seed, cut)
        # Only what follows the continuation is reported new; the whole output is the uninterrupted one.
        assert [t for o in outs for t in o.new_token_ids] == full.token_ids[cut:]
        last = outs[-1]
        assert last.token_ids == full.token_ids and last.finish_reason == full.finish_reason == "length"
        assert [lp.token_id for lp in last.logprobs] == full.token_ids
        assert [round(lp.logprob, 4) for lp in last.logprobs] == [round(lp.logprob, 4) for lp in full.logprobs]
    assert llm.engine.blocks.pool.num_used == 0


def test_a_guided_continuation_replays_its_grammar(zoo_dir):
    """The grammar state is rebuilt from the emitted tokens: the resumed output is the same valid JSON (not a
    second object started at the schema's root), with and without MTP speculation."""
    from zoo.prompts import json_schema_prompt

    target = str(Path(zoo_dir) / "target")
    prompt = json_schema_prompt(SCHEMA)
    params = SamplingParams(max_tokens=60, temperature=0.7, seed=3,
                            structured_output=StructuredOutput(json_schema=SCHEMA))
    plain = LLM(target, num_kv_blocks=256, block_size=16)
    plain.engine.guided.compiler().compile_timeout_s = None
    full = plain.generate([prompt], params)[0]
    assert full.finish_reason == "stop" and len(full.token_ids) > 4
    jsonschema.validate(json.loads(full.text), SCHEMA)
    spec = LLM(target, num_kv_blocks=256, block_size=16,
               speculative=SpecConfig(method="mtp", k=2, draft=str(Path(zoo_dir) / "mtp")))
    spec.engine.guided.compiler().compile_timeout_s = None
    for llm in (plain, spec):
        for cut in (1, len(full.token_ids) // 2, len(full.token_ids) - 1):
            outs = _resume(llm, prompt, params, full, params.seed, cut)
            assert outs[-1].token_ids == full.token_ids, cut
            assert outs[-1].text == full.text
        assert llm.engine.blocks.pool.num_used == 0


def test_a_continuation_that_leaves_nothing_to_generate_is_refused(llama_dir):
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=4)
    params = SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request("r", [5, 9], params, continuation=Continuation((1, 2, 3), seed=1))
    assert e.value.param == "continuation"
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        llm.engine.add_request("r", [5, 9], params, continuation=Continuation((10**9,), seed=1))
    with pytest.raises(InvalidRequestError, match="one per output token"):
        llm.engine.add_request("r", [5, 9], SamplingParams(max_tokens=5, logprobs=1),
                               continuation=Continuation((1, 2), seed=1))
    assert not llm.engine.has_unfinished()
