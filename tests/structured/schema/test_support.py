"""structured/schema/support.py: the walker that names keywords xgrammar cannot enforce, the refusal in
GrammarCompiler (a 400 on response_format), the compile time limit, and faithfulness on real cases."""
import json
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from structured.compiler import GrammarCompiler
from structured.request import StructuredOutput
from structured.schema.rewrite import rewrite
from structured.schema.support import check_enforceable, first_unenforceable
from tests.support.tiny import VOCAB, tiny_tokenizer

CASES = Path("/work/shared/data/jsonschemabench/cases")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tok"))


def _found(schema):
    found = first_unenforceable(schema)
    return None if found is None else (found.keyword, found.path)


@pytest.mark.parametrize("schema, keyword", [
    ({"not": {"type": "string"}}, "not"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
    ({"type": "object", "dependencies": {"a": ["b"]}}, "dependencies"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"type": "integer"}}, "contains"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
    ({"type": "object", "minProperties": 1}, "minProperties"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"allOf": [{"type": "object"}, {"required": ["a"]}]}, "allOf"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "oneOf"),
    # a branch without "type" also accepts null: not disjoint from the null branch
    ({"oneOf": [{"$ref": "#/$defs/t"}, {"type": "null"}], "$defs": {"t": {"properties": {"a": {}}}}}, "oneOf"),
    ({"oneOf": [{"enum": ["x", "yz"]}, {"type": "string", "pattern": "^y"}]}, "oneOf"),  # "yz" matches both
    # without "type": "object" a string satisfies both branches (required/properties hold vacuously)
    ({"oneOf": [{"properties": {"k": {"const": "x"}}, "required": ["k"]},
                {"properties": {"k": {"const": "y"}}, "required": ["k"]}]}, "oneOf"),
    # Regression (JSONSchemaBench Github_hard o71321): branches that require keys they do not declare;
    # xgrammar wrote an object with both required keys
    ({"type": "object", "properties": {"g": {"type": "string"}},
      "oneOf": [{"required": ["symbol"]}, {"required": ["symbols"]}]}, "oneOf"),
    # the first branch admits any key (additionalProperties), so it may write "id" too
    ({"type": "object", "oneOf": [{"properties": {"uri": {}}, "required": ["uri"], "additionalProperties": True},
                                  {"properties": {"id": {}}, "required": ["id"]}]}, "oneOf"),
    ({"type": "string", "pattern": "^a+$", "minLength": 2}, "pattern"),
    ({"type": "string", "pattern": "^(?!x).*$"}, "pattern"),
    ({"type": "string", "pattern": "^a$|^b$"}, "pattern"),
])
def test_each_refused_keyword(schema, keyword):
    assert _found(schema) == (keyword, f"#/{keyword}")


@pytest.mark.parametrize("schema", [
    {"type": "object", "title": "T", "description": "d", "$comment": "c", "examples": [{"not": 1}],
     "default": {"uniqueItems": True}, "properties": {"a": {"type": "string", "description": "not me"}}},
    {"type": "array", "uniqueItems": False, "items": {"type": "integer", "multipleOf": 3}},
    {"oneOf": [{"type": "string"}, {"type": "integer"}]},  # disjoint by type
    {"oneOf": [{"const": "a"}, {"enum": ["b", "c"]}]},  # disjoint literals
    {"type": "object",
     "oneOf": [{"properties": {"kind": {"const": "x"}, "v": {"type": "string"}}, "required": ["kind"]},
               {"properties": {"kind": {"const": "y"}, "v": {"type": "integer"}}, "required": ["kind"]}]},
    {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]},
    {"type": "string", "pattern": "^[a-z^$]+$"},  # anchors inside a class are characters
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},  # property names
    {"oneOf": [{"$ref": "#/$defs/t"}, {"type": "null"}], "$defs": {"t": {"type": "object"}}},  # types through $ref
    {"oneOf": [{"type": "object", "required": ["a"]},  # a required property the other branch forbids
               {"type": "object", "properties": {"b": {}}, "additionalProperties": False}]},
    {"oneOf": [{"enum": ["x", 3]}, {"type": "string", "pattern": "^y"}]},  # literals the validator rejects
    {"oneOf": [{"oneOf": [{"type": "string"}, {"type": "null"}]}, {"type": "integer"}]},  # nested
    # each branch requires a key the other never writes (strict mode: undeclared keys are not written)
    {"type": "object", "oneOf": [{"properties": {"uri": {"type": "string"}}, "required": ["uri"]},
                                 {"properties": {"id": {"type": "string"}}, "required": ["id"]}]},
    # a discriminator the node around the oneOf requires
    {"type": "object", "required": ["op"], "oneOf": [{"properties": {"op": {"enum": ["add", "test"]}}},
                                                     {"properties": {"op": {"enum": ["remove"]}}}]},
])
def test_annotations_and_enforceable_schemas_pass(schema):
    assert first_unenforceable(rewrite(schema)) is None  # as the engine plans: after the exact rewrites


def test_nested_paths_and_defs():
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"}},
                                               "meta": {"anyOf": [{"type": "null"}, {"not": {"type": "string"}}]}},
              "$defs": {"tag": {"type": "array", "uniqueItems": True}}}
    assert _found(schema) == ("not", "#/properties/meta/anyOf/1/not")
    del schema["properties"]["meta"]
    assert _found(schema) == ("uniqueItems", "#/$defs/tag/uniqueItems")
    assert _found({"definitions": {"a/b": {"if": {}}}}) == ("if", "#/definitions/a~1b/if")


def test_check_enforceable_message_names_keyword_and_path():
    with pytest.raises(InvalidRequestError) as err:
        check_enforceable({"properties": {"x": {"type": "array", "uniqueItems": True}}})
    assert err.value.param == "response_format" and err.value.http_status == 400
    assert "'uniqueItems'" in err.value.message and "#/properties/x/uniqueItems" in err.value.message


def test_refused_schema_is_a_400_before_compiling(tokenizer):
    """Regression: a schema with a keyword xgrammar ignores used to compile and let invalid JSON through."""
    compiler = GrammarCompiler(tokenizer, VOCAB, compile_timeout_s=None)
    with pytest.raises(InvalidRequestError) as err:
        compiler.compile(StructuredOutput(json_schema={"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}))
    assert err.value.param == "response_format" and err.value.http_status == 400
    assert "'uniqueItems'" in err.value.message
    assert compiler.compile(StructuredOutput(json_schema={"type": "object", "title": "ok"})) is not None


def test_compile_past_the_time_limit_is_ended(tokenizer):
    """A schema whose compile takes seconds (large bounded regex repetitions) gets a 400 naming the
    limit, its compile process is killed, and the next compile works in a fresh one."""
    slow = {"type": "object", "properties": {f"p{i}": {"type": "string", "pattern": "^([a-z]{1,20}[0-9]{1,20}){1,400}$"}
                                             for i in range(10)}}
    compiler = GrammarCompiler(tokenizer, VOCAB, compile_timeout_s=0.3)
    try:
        with pytest.raises(InvalidRequestError) as err:
            compiler.compile(StructuredOutput(json_schema=slow))
        assert err.value.param == "response_format" and "0.3 s" in err.value.message
        compiled = compiler.compile(StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}}))
        state = compiler.new_state(compiled)
        assert state.matcher.accept_string('{"a": 7}') and state.matcher.is_completed()
        with pytest.raises(InvalidRequestError, match="cannot compile"):
            compiler.compile(StructuredOutput(json_schema={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}))
    finally:
        compiler._worker.close()


def _case_files(n: int) -> list[Path]:
    if not CASES.is_dir():
        pytest.skip(f"shared JSONSchemaBench cases not found at {CASES} (../shared/data); faithfulness not checked")
    from bench.structured import sample_cases

    return sample_cases(CASES, n)


def test_refusal_removes_leaks_on_real_cases(tokenizer):
    """On a spread of real cases, invalid instances the matcher accepts ("leaks") are counted for all
    compiled schemas and for the schemas the engine serves: the refusal must remove leaks, and what
    it serves must leak at most once in the sample. Known residual (bench/results/structured_faithfulness_cpu.json,
    leaking_cases): Github_medium---o21112 accepts `"deliveryTypes": []` despite minItems 1, a miss
    of xgrammar's inside that object that standalone arrays do not show; not yet attributed."""
    import xgrammar as xgr

    from bench.structured import serialize

    compiler = GrammarCompiler(tokenizer, VOCAB, compile_timeout_s=None)
    leaks_all, leaks_served, checked = set(), set(), 0
    for path in _case_files(60):
        case = json.loads(path.read_text())
        refused = first_unenforceable(rewrite(case["schema"])) is not None
        try:
            compiled = compiler.compile(StructuredOutput(json_schema=case["schema"])) if not refused else \
                compiler._compiler.compile_json_schema(json.dumps(case["schema"]), any_whitespace=False,
                                                        separators=(", ", ": "))
        except (InvalidRequestError, RuntimeError):
            continue
        for test in (t for t in case["tests"] if not t["valid"]):
            checked += 1
            matcher = xgr.GrammarMatcher(compiled)
            if matcher.accept_string(serialize(test["data"], case["schema"])) and matcher.is_completed():
                leaks_all.add(path.name)
                leaks_served.update([] if refused else [path.name])
    assert checked > 20
    assert len(leaks_served) < len(leaks_all), (leaks_all, leaks_served)
    assert len(leaks_served) <= 1, f"served schemas accepted invalid instances: {sorted(leaks_served)}"


@pytest.mark.parametrize("pattern, misread", [
    (r"^a(:[^\s]+)?$", True),  # xgrammar accepted "a:"
    (r"^a(\.[0-9]+)?$", True),  # xgrammar accepted "a1"
    (r"^[a-z]{2}(-x(-[a-z0-9]{1,8})+)?$", True),  # nested, JSONSchemaBench Github_hard o58443
    (r"^a(:[^\s]+)*$", False),  # a star group is read right
    (r"^a(:[^:]+)?b$", False),  # not at the end
    (r"^a(-[a-z]{4})?$", False),  # no "+" inside
    (r"^a(:[0-9]+)?$", False),  # positive classes only: read right
    (r"^(?:(?:\S+\s+){0,9}\S+)?$", False),  # the group is the whole regex: read right
])
def test_a_trailing_optional_group_with_a_repetition_goes_elsewhere(pattern, misread):
    found = first_unenforceable({"type": "string", "pattern": pattern})
    assert (found is not None and "optional group" in found.reason) == misread
