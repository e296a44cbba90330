"""structured/request.py with real xgrammar: compile, mask, accept, roll back, serialize; constrained
decoding of random logits yields instances that jsonschema validates."""
import json

import jsonschema
import pytest
import torch

from engine.errors import InvalidRequestError
from structured.compiler import GrammarCompiler
from structured.request import StructuredOutput
from tests.support.grammar import closing_bias, walk_tokens
from tests.support.tiny import VOCAB, tiny_tokenizer
from tests.support.tool_calls import TOOL_SCHEMA, call_tag

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "kind": {"enum": ["cat", "dog"]},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "kind", "ok"]}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB)


def _walk(compiler, tokenizer, spec, seed, max_steps=300, bias=None):
    """Greedy decoding of random logits under the grammar mask until the matcher terminates."""
    return tokenizer.decode(walk_tokens(compiler, spec, seed, max_steps, bias)[0])


@pytest.mark.parametrize("seed", range(4))
def test_constrained_random_decoding_validates(compiler, tokenizer, seed):
    """Regression: xgrammar's string rule admits raw control characters (seed 1 produced "\\x05"),
    which strict JSON parsers reject; compact JSON grammars mask those tokens out."""
    text = _walk(compiler, tokenizer, StructuredOutput(json_schema=SCHEMA), seed)
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("seed", range(3))
def test_json_object(compiler, tokenizer, seed):
    value = json.loads(_walk(compiler, tokenizer, StructuredOutput(json_object=True), seed,
                             bias=closing_bias(tokenizer, '}"', 3.0, (tokenizer.eos_token_id,))))
    assert isinstance(value, dict)


def test_choice_and_regex(compiler, tokenizer):
    assert _walk(compiler, tokenizer, StructuredOutput(choice=["red", "green", "blue"]), 0) in ("red", "green", "blue")
    text = _walk(compiler, tokenizer, StructuredOutput(regex=r"[0-9]{3}-[a-z]{2}"), 1)
    assert len(text) == 6 and text[:3].isdigit() and text[3] == "-" and text[4:].isalpha()


def test_valid_instance_accepted_invalid_rejected(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutput(json_schema=SCHEMA))
    good = tokenizer.encode(json.dumps({"name": "Ada", "kind": "cat", "ok": True}))
    state = compiler.new_state(compiled)
    assert all(state.accept(t) for t in good)
    assert state.accept(tokenizer.eos_token_id) and state.terminated
    bad = tokenizer.encode(json.dumps({"name": "Ada", "kind": "cow", "ok": True}))
    state = compiler.new_state(compiled)
    assert not all(state.accept(t) for t in bad)


def test_rollback_restores_the_mask(compiler, tokenizer):
    state = compiler.new_state(compiler.compile(StructuredOutput(json_schema=SCHEMA)))
    prefix = tokenizer.encode('{"name": "A')
    for t in prefix[:2]:
        assert state.accept(t)
    before = compiler.allocate_bitmask(1)
    state.fill_bitmask(before, 0)
    for t in prefix[2:]:
        assert state.accept(t)
    state.rollback(len(prefix) - 2)
    after = compiler.allocate_bitmask(1)
    state.fill_bitmask(after, 0)
    assert torch.equal(before, after)


def test_cache_and_serialization(compiler, tokenizer):
    a = StructuredOutput(json_schema=SCHEMA)
    b = StructuredOutput(json_schema=json.dumps(SCHEMA))  # same schema as a string: same key
    assert a.key() == b.key()
    assert compiler.compile_async(a) is compiler.compile_async(b)
    restored = compiler.deserialize(compiler.serialize(compiler.compile(a)))
    m1, m2 = compiler.allocate_bitmask(1), compiler.allocate_bitmask(1)
    compiler.new_state(compiler.compile(a)).fill_bitmask(m1, 0)
    compiler.new_state(restored).fill_bitmask(m2, 0)
    assert torch.equal(m1, m2)


@pytest.mark.parametrize("spec", [
    dict(json_schema='{"type": "object", '),
    dict(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
    dict(regex="(unclosed"),
    dict(grammar="root ::= missing_rule"),
])
def test_bad_grammars_are_invalid_requests(compiler, spec):
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(StructuredOutput(**spec))
    assert e.value.param == "response_format"


def test_exactly_one_kind():
    with pytest.raises(InvalidRequestError):
        StructuredOutput()
    with pytest.raises(InvalidRequestError):
        StructuredOutput(regex="a", json_object=True)


def test_a_failed_compilation_is_not_cached(compiler):
    """Regression: a failed compile_async future stayed in the cache, so every later request with the
    same source got the old failure without being compiled again."""
    bad = StructuredOutput(regex="(unclosed")
    fut = compiler.compile_async(bad)
    with pytest.raises(InvalidRequestError):
        fut.result()
    assert compiler.compile_async(bad) is not fut


def test_the_compiler_cache_is_bounded_by_xgrammar_bytes(tokenizer):
    """Three grammars, a byte bound that holds two of them: the least recently used one leaves."""
    from structured.cache import compiled_size

    specs = [StructuredOutput(regex=r) for r in ("[a-c]{3}", "[d-f]{3}", "[g-i]{3}")]
    probe = GrammarCompiler(tokenizer, VOCAB, compile_timeout_s=None)
    sizes = [compiled_size(probe.compile(s)) for s in specs]
    compiler = GrammarCompiler(tokenizer, VOCAB, compile_timeout_s=None,
                               max_cache_bytes=sizes[0] + sizes[1] + min(sizes) // 2)
    a, b, c = (s.key() for s in specs)
    compiler.compile(specs[0])
    compiler.compile(specs[1])
    compiler.compile(specs[0])  # a hit: a is the most recently used now
    compiler.compile(specs[2])
    assert compiler.cache.keys() == [a, c] and compiler.cache.nbytes == sizes[0] + sizes[2]
    assert compiler.stats == {"compiles": 3, "cache_hits": 1, "deserializations": 0, "llguidance_compiles": 0,
                              "llguidance_cache_hits": 0, "llguidance_deserializations": 0}


@pytest.mark.parametrize("text_around", [False, True])
def test_a_structural_tag_compiles_and_serializes(compiler, tokenizer, text_around):
    tool = StructuredOutput(structural_tag=call_tag(TOOL_SCHEMA, text_around))
    assert tool.kind == "structural_tag" and tool.param == "tools" and not tool.is_compact_json
    assert StructuredOutput.from_dict(tool.to_dict()) == tool
    assert StructuredOutput(structural_tag=tool.canonical_source()).key() == tool.key()
    restored = compiler.deserialize(compiler.serialize(compiler.compile(tool)))
    state = compiler.new_state(restored, tool)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    assert all(state.accept(t) for t in tokenizer.encode(call, add_special_tokens=False))
    bad = compiler.new_state(restored, tool)
    ids = tokenizer.encode(call.replace("Oslo", "Rome"), add_special_tokens=False)
    assert not all(bad.accept(t) for t in ids)


@pytest.mark.parametrize("tag", [
    call_tag({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}),  # unenforceable
    call_tag({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),  # does not compile
    {"type": "structural_tag", "format": {"type": "no_such_format"}},
])
def test_bad_structural_tags_are_invalid_requests_blamed_on_tools(compiler, tag):
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(StructuredOutput(structural_tag=tag))
    assert e.value.param == "tools"
