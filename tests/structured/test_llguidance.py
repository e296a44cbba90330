"""structured/llguidance.py through GrammarCompiler: JSON schemas xgrammar would not enforce are
compiled by llguidance, with xgrammar's bitmask layout and matcher semantics (rejected tokens change
nothing, EOS only at the grammar's end, rollback over EOS), content-addressed by backend, serialized
for the hand-over, bounded in the cache and time-limited in the compile process."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from engine.errors import InvalidRequestError
from structured import llguidance as llg
from structured.compiler import GrammarCompiler
from structured.request import StructuredOutput
from tests.support.grammar import walk_tokens
from tests.support.tiny import VOCAB, tiny_tokenizer

pytestmark = pytest.mark.skipif(not llg.available(), reason="llguidance is not installed")
EOS = 1
# multipleOf on a number: xgrammar ignores it (structured/schema/support.py), llguidance enforces it
HALVES = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                           "w": {"type": "number", "multipleOf": 0.5, "minimum": 0, "maximum": 9}},
          "required": ["kind", "w"], "additionalProperties": False}
SPEC = StructuredOutput(json_schema=HALVES)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, VOCAB, [EOS])


def _allowed(mask_row: torch.Tensor) -> set[int]:
    """Token ids whose bit is set, read as kernels/bitmask.py reads them: bit t % 32 of word t // 32."""
    return {t for t in range(VOCAB) if (int(mask_row[t // 32]) >> (t % 32)) & 1}


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_plan_sends_only_unenforceable_schemas_to_llguidance():
    assert SPEC.plan.backend == "llguidance" and "'multipleOf'" in SPEC.plan.refusal
    assert StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}}).plan.backend == "xgrammar"
    assert StructuredOutput(json_schema=HALVES, compact=False).plan.backend == "xgrammar"  # refused at once there
    assert StructuredOutput(regex="[ab]+").plan.backend == "xgrammar"


def test_the_cache_key_includes_the_backend(monkeypatch):
    """The same source planned for another backend (here: llguidance not installed) is another entry."""
    key = StructuredOutput(json_schema=HALVES).key()
    monkeypatch.setattr(llg, "available", lambda: False)
    other = StructuredOutput(json_schema=HALVES)
    assert other.plan.backend == "xgrammar" and other.key() != key


def test_the_bitmask_layout_is_xgrammars(compiler, tokenizer):
    """llguidance's mask, written into our int32 rows, allows exactly the tokens llguidance itself
    allows per token (compute_logit_bias: one byte per token), at every step of an instance."""
    state = compiler.new_state(compiler.compile(SPEC))
    mask = compiler.allocate_bitmask(2)
    for token in _ids(tokenizer, '{"kind": "dog", "w": 4.5}') + [EOS]:
        state.fill_bitmask(mask, 1)
        bias = state.matcher.compute_logit_bias()
        assert _allowed(mask[1]) == {t for t in range(VOCAB) if bias[t]}
        assert int(mask[0].sum()) == -((VOCAB + 31) // 32)  # row 0 untouched (all bits set)
        assert state.accept(token)
    assert state.terminated


@pytest.mark.parametrize("seed", range(3))
def test_constrained_random_decoding_validates(compiler, seed):
    out, token = walk_tokens(compiler, SPEC, seed, max_steps=60)  # raises unless the matcher terminated
    assert token == EOS
    text = compiler.tokenizer_info.decoded_vocab  # bytes per token
    jsonschema.validate(json.loads(b"".join(text[t] for t in out).decode()), HALVES)


def test_eos_only_at_the_end_and_rejections_change_nothing(compiler, tokenizer):
    state = compiler.new_state(compiler.compile(SPEC), SPEC)
    ids = _ids(tokenizer, '{"kind": "cat", "w": 2.5}')
    before, after = compiler.allocate_bitmask(1), compiler.allocate_bitmask(1)
    for t in ids[:3]:
        assert state.accept(t)
    state.fill_bitmask(before, 0)
    assert EOS not in _allowed(before[0]) and not state.accept(EOS) and not state.terminated
    assert not state.accept(_ids(tokenizer, "}")[0])  # llguidance would enter its error state for good
    state.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    for t in ids[3:]:
        assert state.accept(t)
    state.fill_bitmask(after, 0)
    assert _allowed(after[0]) == {EOS} and state.accept(EOS) and state.terminated
    assert not state.accept(EOS)  # nothing after the end
    state.rollback(2)  # the EOS and "}" (or what closed it): the grammar is open again
    assert not state.terminated
    state.fill_bitmask(after, 0)
    assert EOS not in _allowed(after[0])
    state.rollback(len(ids) - 1)
    state.fill_bitmask(after, 0)
    fresh = compiler.allocate_bitmask(1)
    compiler.new_state(compiler.compile(SPEC), SPEC).fill_bitmask(fresh, 0)
    assert torch.equal(after, fresh)


def test_valid_instances_accepted_invalid_rejected(compiler, tokenizer):
    """What xgrammar would have let through (4.25 is no multiple of 0.5) llguidance rejects."""
    def completes(text: str) -> bool:
        state = compiler.new_state(compiler.compile(SPEC), SPEC)
        return all(state.accept(t) for t in _ids(tokenizer, text)) and state.accept(EOS)

    assert completes('{"kind": "cat", "w": 4.5}') and completes('{"kind": "dog", "w": 0}')
    assert not completes('{"kind": "cat", "w": 4.25}') and not completes('{"kind": "cat", "w": 9.5}')
    assert not completes('{"kind": "cow", "w": 1}')


def test_serialization_round_trip_and_counters(compiler, tokenizer):
    """The decode side builds the matcher from the grammar text without compiling; a second adopt of
    the same content key is a cache hit. Counters split by backend."""
    serialized = compiler.serialized(SPEC) or compiler.serialize(compiler.compile(SPEC))
    assert serialized.backend == "llguidance" and json.loads(serialized.text)["grammars"]
    decode = GrammarCompiler(tokenizer, VOCAB, [EOS])
    for _ in range(2):
        grammar = decode.adopt(SPEC, serialized)
    assert decode.stats == {"compiles": 0, "cache_hits": 1, "deserializations": 1, "llguidance_compiles": 0,
                            "llguidance_cache_hits": 1, "llguidance_deserializations": 1}
    m1, m2 = compiler.allocate_bitmask(1), compiler.allocate_bitmask(1)
    compiler.new_state(compiler.compile(SPEC), SPEC).fill_bitmask(m1, 0)
    decode.new_state(grammar, SPEC).fill_bitmask(m2, 0)
    assert torch.equal(m1, m2)
    with pytest.raises(InvalidRequestError) as e:  # a header naming the other backend is not loaded
        decode.adopt(SPEC, type(serialized)("xgrammar", serialized.text))
    assert e.value.param == "handover"


def test_the_cache_bounds_llguidance_grammars_by_bytes(tokenizer):
    specs = [StructuredOutput(json_schema={**HALVES, "title": str(i)}) for i in range(3)]
    probe = GrammarCompiler(tokenizer, VOCAB, [EOS], compile_timeout_s=None)
    sizes = [probe.compile(s).memory_size_bytes for s in specs]
    assert all(s > len(probe.serialize(probe.compile(spec)).text) for s, spec in zip(sizes, specs))
    compiler = GrammarCompiler(tokenizer, VOCAB, [EOS], compile_timeout_s=None,
                               max_cache_bytes=sizes[0] + sizes[1] + min(sizes) // 2)
    for s in specs:
        compiler.compile(s)
    assert compiler.cache.keys() == [specs[1].key(), specs[2].key()] and compiler.cache.nbytes == sizes[1] + sizes[2]


def test_a_schema_neither_backend_enforces_is_refused_naming_both(compiler):
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(StructuredOutput(json_schema={"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}))
    assert e.value.param == "response_format" and "'uniqueItems'" in e.value.message
    assert "llguidance cannot enforce it either" in e.value.message and "Unimplemented" in e.value.message


SLOW = Path("/work/shared/data/jsonschemabench/cases/JsonSchemaStore---jreleaser-1.7.0.json")


def test_an_llguidance_compile_past_the_time_limit_is_ended(tokenizer):
    """llguidance validates in the compile process too: a schema whose validation takes ~2 s (a real
    one: 226 definitions, 58 allOf intersections) gets a 400 naming the limit, and the next compile
    works in a fresh process."""
    if not SLOW.is_file():
        pytest.skip(f"{SLOW} (shared JSONSchemaBench cases) not found")
    slow = StructuredOutput(json_schema=json.loads(SLOW.read_text())["schema"])
    assert slow.plan.backend == "llguidance"
    compiler = GrammarCompiler(tokenizer, VOCAB, [EOS], compile_timeout_s=0.3)
    try:
        with pytest.raises(InvalidRequestError) as err:
            compiler.compile(slow)
        assert err.value.param == "response_format" and "0.3 s" in err.value.message
        assert compiler.compile(SPEC).template is not None
    finally:
        compiler._worker.close()


def test_presence_rewrites_reach_llguidance(compiler, tokenizer):
    """A dependency (structured/schema/presence.py writes it as anyOf over key presence) is served by
    llguidance and enforced: "a" only together with "b"."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "dependencies": {"a": ["b"]}}
    spec = StructuredOutput(json_schema=schema)
    assert spec.plan.backend == "llguidance" and "'dependencies'" in spec.plan.refusal
    grammar = compiler.compile(spec)

    def completes(text: str) -> bool:
        state = compiler.new_state(grammar, spec)
        return all(state.accept(t) for t in _ids(tokenizer, text)) and state.accept(EOS)

    assert completes('{"a": 1, "b": 2}') and completes('{"b": 2}') and completes("{}")
    assert not completes('{"a": 1}')


@pytest.mark.parametrize("pattern", ["^[^\\\\]+$", '^[^"]*$', "^[^\\x22]+$", "^[^!-#]+$"])
def test_a_negated_class_excluding_a_json_escape_is_refused(compiler, pattern):
    """Regression (JSONSchemaBench JsonSchemaStore libman, served by llguidance, accepted
    "js\\\\subfolder/" for `^[^\\\\]+$`): llguidance lets the escapes \\\\ and \\" through a negated class
    that excludes \\ or ", so such patterns are refused rather than served."""
    schema = {**HALVES, "properties": {**HALVES["properties"], "p": {"type": "string", "pattern": pattern}}}
    with pytest.raises(InvalidRequestError) as e:
        compiler.compile(StructuredOutput(json_schema=schema))
    assert "llguidance cannot enforce it either" in e.value.message and "negated class" in e.value.message
    fine = {**schema, "properties": {**schema["properties"], "p": {"type": "string", "pattern": "^[^a-z]+$"}}}
    assert compiler.compile(StructuredOutput(json_schema=fine)).template is not None


OVERLAPPING_ONE_OF = {"type": "object", "properties": {
    "w": {"type": "number", "multipleOf": 0.5}, "kind": {"type": "string", "maxLength": 3},
    "n": {"type": "integer", "maximum": 99}, "s": {"type": "string", "maxLength": 4}},
    "oneOf": [{"properties": {"kind": {"const": "a"}}, "required": ["n"]},
              {"properties": {"kind": {"enum": ["b", "c"]}}, "required": ["s"]}],
    "required": ["w"], "additionalProperties": False}


@pytest.mark.parametrize("seed", range(4))
def test_an_overlapping_oneof_is_served_narrowed_and_what_it_writes_is_valid(compiler, seed):
    """Overlapping oneOf branches (an object with n and s satisfies both) are narrowed until disjoint
    (structured/schema/one_of.py (narrowed_one_of)): llguidance serves the schema and every output is valid
    against the user's schema, oneOf and all."""
    spec = StructuredOutput(json_schema=OVERLAPPING_ONE_OF)
    out, token = walk_tokens(compiler, spec, seed, max_steps=300)
    assert token == EOS and spec.plan.backend == llg.BACKEND
    text = compiler.tokenizer_info.decoded_vocab
    jsonschema.validate(json.loads(b"".join(text[t] for t in out).decode()), OVERLAPPING_ONE_OF)
