"""engine/masking/grammar.py: guided requests in the engine's step, with real xgrammar.

The grammars (tests/support/guided.py) describe finite languages (enums, booleans, bounded regexes,
choices), so even the random test model always completes them: every guided output must finish with
"stop" and validate (jsonschema, re.fullmatch, membership). Speculative guided output must equal non-speculative guided
output token for token (masks on verification rows and on draft steps keep it lossless), in mixed
batches with unguided requests, with chunked prefill, and across a prefill -> decode hand-over.
"""
from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, EngineConfig, HandoverRequest, InvalidRequestError, LLMEngine, SamplingParams, StructuredOutput
from tests.support.guided import GUIDES, guided_batch, guided_params, is_valid
from tests.support.spec import random_prompts, spec_config
from tests.support.tool_calls import TOOL_SCHEMA, call_tag

NO_LLGUIDANCE = {"llguidance_compiles": 0, "llguidance_cache_hits": 0, "llguidance_deserializations": 0}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(one_thread_module):
    """Tiny models: one intra-op thread (tests/engine/conftest.py)."""


def test_guided_outputs_complete_and_validate(llama_dir):
    prompts, params, kinds = guided_batch(8)
    llm = LLM(llama_dir, num_kv_blocks=512, block_size=4)
    outs = llm.generate(prompts, params)
    for o, kind in zip(outs, kinds):
        if kind is not None:
            assert o.finish_reason == "stop" and is_valid(kind, o.text), (kind, o.text)
    assert llm.engine.stats()["kv_blocks_used"] == 0 and not llm.engine.guided.grammar.states


@pytest.mark.parametrize("method", ["self_draft", "eagle3", "mtp", "ngram"])
@pytest.mark.parametrize("chunked", [False, True])
def test_guided_speculation_equals_guided_plain_decoding(llama_dir, spec_drafts, method, chunked):
    """Greedy: token for token. Sampled: still complete and valid (rejection sampling against masked
    target and draft distributions)."""
    prompts, params, kinds = guided_batch(8)
    kw = dict(num_kv_blocks=512, block_size=4, max_num_batched_tokens=24 if chunked else 2048)
    ref = LLM(llama_dir, **kw).generate(prompts, params)
    llm = LLM(llama_dir, speculative=spec_config(method, 3, spec_drafts, llama_dir), **kw)
    outs = llm.generate(prompts, params)
    for o, r, p, kind in zip(outs, ref, params, kinds):
        if p.temperature == 0:
            assert o.token_ids == r.token_ids, kind
        if kind is not None:
            assert o.finish_reason == "stop" and is_valid(kind, o.text), (kind, o.text)
    assert llm.engine.stats()["kv_blocks_used"] == 0 and not llm.engine.guided.grammar.states


def test_a_bad_grammar_is_refused_and_others_keep_running(llama_dir):
    """A schema keyword no backend can enforce is refused: by add_request at once where only xgrammar
    could serve the request (non-compact JSON), else by the compile, which llguidance runs in the
    compile process (it may take seconds, so never on the caller's thread): that request, like one
    whose grammar fails to compile, finishes with finish_reason "error" and an InvalidRequestError
    naming the parameter and both backends' reasons, its blocks and matcher freed."""
    negation = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}  # item uniqueness: neither backend
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4))
    engine.add_request("good", [5, 6, 7], guided_params(0, "regex"))
    with pytest.raises(InvalidRequestError) as e:
        engine.add_request("refused", [5, 6, 7], SamplingParams(structured_output=StructuredOutput(
            json_schema=negation, compact=False)))
    assert e.value.param == "response_format" and "refused" not in engine.requests and "'uniqueItems'" in e.value.message
    engine.add_request("neither", [5, 6, 7], SamplingParams(structured_output=StructuredOutput(json_schema=negation)))
    engine.add_request("bad", [5, 6, 7], SamplingParams(structured_output=StructuredOutput(regex="(unclosed")))
    done = []
    while engine.has_unfinished():
        done += [o for o in engine.step() if o.finished]
    by_id = {o.request_id: o for o in done}
    assert sorted(by_id) == ["bad", "good", "neither"] and is_valid("regex", by_id["good"].text)
    bad, neither = by_id["bad"], by_id["neither"]
    assert bad.finish_reason == "error" and bad.token_ids == [] and isinstance(bad.error, InvalidRequestError)
    assert bad.error.param == "response_format" and "cannot compile" in bad.error.message
    assert neither.finish_reason == "error" and neither.token_ids == [] and neither.error.param == "response_format"
    assert "'uniqueItems'" in neither.error.message and "llguidance cannot enforce it either" in neither.error.message
    assert not engine.guided.grammar.states and engine.stats()["kv_blocks_used"] == 0


def test_abort_frees_the_matcher(llama_dir):
    engine = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=64, block_size=4))
    engine.add_request("r", [5, 6, 7], guided_params(0, "json_schema"))
    engine.step()
    engine.abort("r")
    engine.step()
    assert not engine.guided.grammar.states and engine.stats()["kv_blocks_used"] == 0


def _prefilled(llama_dir, prompt, params):
    """A prefill engine that ran the request to its hand-over, a fresh decode engine, and the hand-over."""
    prefill = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=128, block_size=4))
    decode = LLMEngine(EngineConfig(model=llama_dir, num_kv_blocks=128, block_size=4))
    prefill.add_request("r", prompt, params, prefill_only=True)
    while prefill.requests["r"].status.value != "parked":
        prefill.step()
    return prefill, decode, prefill.take_handover("r")


def _decode_handover(prefill, decode, h, request, compiled) -> list:
    """Reserve on the decode side, copy the KV over, commit, decode to the end; the finished outputs."""
    blocks = decode.reserve(request, compiled)
    decode.kv_cache[:, :, blocks] = prefill.kv_cache[:, :, h.block_ids]
    prefill.release("r")
    decode.commit("r")
    done = []
    while decode.has_unfinished():
        done += [o for o in decode.step() if o.finished]
    return done


def test_guided_request_survives_a_handover(llama_dir):
    """Prefill samples the first token under the grammar; the decode engine rebuilds the matcher from
    the hand-over's description (structured output and tokens) and continues to the same tokens."""
    prompt, params = random_prompts(1, seed=3)[0], guided_params(0, "json_schema")
    want = LLM(llama_dir, num_kv_blocks=128, block_size=4).generate(prompt, params)[0]
    prefill, decode, h = _prefilled(llama_dir, prompt, params)
    assert h.compiled_grammar is not None
    done = _decode_handover(prefill, decode, h, HandoverRequest.from_dict(h.request.to_dict()),  # wire forms
                            h.compiled_grammar)
    assert done[0].token_ids == want.token_ids and is_valid("json_schema", done[0].text)
    assert not prefill.guided.grammar.states and not decode.guided.grammar.states
    assert prefill.stats()["grammar"]["compiles"] == 1
    assert decode.stats()["grammar"] == {"compiles": 0, "cache_hits": 0, "deserializations": 1, **NO_LLGUIDANCE}


def test_a_tool_call_grammar_is_compiled_on_prefill_and_deserialized_on_decode(llama_dir):
    """A structural-tag grammar (tool calls, router/tools.py's shape) travels like any other: the
    prefill engine compiles it, the hand-over header carries the StructuredOutput and the serialized
    grammar over the wire format, and the decode engine loads it without compiling; the output is a
    call whose arguments validate."""
    from cluster.protocol import GrammarHandover, HandoverHeader, PayloadPart

    tool = StructuredOutput(structural_tag=call_tag(TOOL_SCHEMA))
    params = SamplingParams(max_tokens=80, temperature=0, structured_output=tool)
    prompt = random_prompts(1, seed=5)[0]
    want = LLM(llama_dir, num_kv_blocks=128, block_size=4).generate(prompt, params)[0]
    prefill, decode, h = _prefilled(llama_dir, prompt, params)
    header = HandoverHeader(h.request, (PayloadPart.KV,), GrammarHandover.of(tool.key(), h.compiled_grammar,
                                                                          tool.plan.backend))
    back = HandoverHeader.from_wire(header.to_wire())
    assert back == header and back.request.params.structured_output == tool
    assert back.grammar.cache_key == back.request.params.structured_output.key()
    done = _decode_handover(prefill, decode, h, back.request, back.grammar.serialized)
    assert done[0].token_ids == want.token_ids and done[0].finish_reason == "stop"
    head, body = '<tool_call>\n{"name": "weather", "arguments": ', "}\n</tool_call>"
    assert done[0].text.startswith(head) and done[0].text.endswith(body)
    jsonschema.validate(json.loads(done[0].text[len(head):-len(body)]), TOOL_SCHEMA)
    assert decode.stats()["grammar"] == {"compiles": 0, "cache_hits": 0, "deserializations": 1, **NO_LLGUIDANCE}


# A schema xgrammar would not enforce (minProperties) and llguidance does: served by llguidance.
LLG_SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"}},
              "required": ["kind", "ok"], "additionalProperties": False, "minProperties": 2}


def _llg_params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=48, temperature=0, seed=7 + i,
                          structured_output=StructuredOutput(json_schema=LLG_SCHEMA))


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_an_llguidance_schema_greedy_and_speculative_equal_and_validate(llama_dir, spec_drafts, method):
    """Through the step: greedy guided output of an llguidance-served schema, batched with xgrammar-
    guided and unguided requests; MTP (or EAGLE-3, whose draft masks go through d2t) at k = 3 (masks
    on verification rows and on draft steps, the matcher rolled back over rejected drafts) gives the
    same tokens, and every output validates."""
    assert StructuredOutput(json_schema=LLG_SCHEMA).plan.backend == "llguidance"
    prompts = random_prompts(6, seed=31)
    xgrammar = SamplingParams(max_tokens=48, temperature=0, structured_output=GUIDES["json_schema"])
    params = [_llg_params(i) if i % 2 == 0 else xgrammar if i % 3 else SamplingParams(max_tokens=24, temperature=0)
              for i in range(6)]
    kw = dict(num_kv_blocks=512, block_size=4)
    ref_llm = LLM(llama_dir, **kw)
    ref = ref_llm.generate(prompts, params)
    spec = LLM(llama_dir, speculative=spec_config(method, 3, spec_drafts, llama_dir), **kw)
    outs = spec.generate(prompts, params)
    for i, (o, r) in enumerate(zip(outs, ref)):
        assert o.token_ids == r.token_ids, i
        if i % 2 == 0:
            assert o.finish_reason == "stop"
            jsonschema.validate(json.loads(o.text), LLG_SCHEMA)
    for llm in (ref_llm, spec):
        stats = llm.engine.stats()
        assert stats["grammar"]["llguidance_compiles"] == 1 and stats["grammar"]["llguidance_cache_hits"] == 2
        assert stats["kv_blocks_used"] == 0 and not llm.engine.guided.grammar.states


def test_an_llguidance_grammar_survives_a_handover(llama_dir):
    """The header carries the backend and llguidance's grammar text (wire format); the decode engine
    builds its matcher from them (no compile; the template ahead of the reserve), replays the prefill's accepted tokens and continues to
    the single engine's tokens."""
    from cluster.protocol import GrammarHandover, HandoverHeader, PayloadPart

    prompt, params = random_prompts(1, seed=4)[0], _llg_params(0)
    structured = params.structured_output
    want = LLM(llama_dir, num_kv_blocks=128, block_size=4).generate(prompt, params)[0]
    prefill, decode, h = _prefilled(llama_dir, prompt, params)
    assert h.compiled_grammar.backend == "llguidance" and h.request.output_token_ids  # the first token, sampled
    header = HandoverHeader(h.request, (PayloadPart.KV,), GrammarHandover.of(structured.key(), h.compiled_grammar,
                                                                             structured.plan.backend))
    back = HandoverHeader.from_wire(header.to_wire())
    assert back.grammar.backend == "llguidance" and back.grammar.cache_key == back.request.params.structured_output.key()
    # the decode rank loads it as the header lands (its channel thread), so reserve finds it cached
    decode.warm_grammar(back.request.params.structured_output, back.grammar.serialized)
    done = _decode_handover(prefill, decode, h, back.request, back.grammar.serialized)
    assert done[0].token_ids == want.token_ids and done[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done[0].text), LLG_SCHEMA)
    assert prefill.stats()["grammar"]["llguidance_compiles"] == 1
    assert decode.stats()["grammar"] == {"compiles": 0, "cache_hits": 1, "deserializations": 1, "llguidance_compiles": 0,
                                         "llguidance_cache_hits": 1, "llguidance_deserializations": 1}
