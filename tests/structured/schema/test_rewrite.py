"""structured/schema/rewrite.py: each rewrite gives an equivalent schema (checked with jsonschema on the
rewrite's own candidates and on random strings) that structured.schema.support no longer refuses, and
xgrammar enforces the result."""
import random

import jsonschema
import pytest

from structured.schema.regex import bounded_pattern
from structured.schema.rewrite import rewrite
from structured.schema.support import first_unenforceable


def _same_verdicts(a, b, instances):
    va, vb = jsonschema.Draft202012Validator(a), jsonschema.Draft202012Validator(b)
    for x in instances:
        assert va.is_valid(x) == vb.is_valid(x), x


def _strings(alphabet: str, n: int, max_len: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [''.join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len))) for _ in range(n)]


def test_enum_under_not_and_allof_becomes_the_filtered_enum():
    """JSONSchemaBench Synthesized: allOf [enum, not not X] is refused for `not`; it is a finite set."""
    schema = {"allOf": [{"enum": [{"foo": "bar"}, {"foo": "bar", "x": 1}, 3]},
                        {"not": {"not": {"type": "object", "additionalProperties": {"type": "string"}}}}]}
    assert first_unenforceable(schema).keyword == "allOf"
    out = rewrite(schema)
    assert out == {"enum": [{"foo": "bar"}]}
    assert first_unenforceable(out) is None
    _same_verdicts(schema, out, [{"foo": "bar"}, {"foo": "bar", "x": 1}, 3, "foo", None])


def test_finite_oneof_keeps_values_in_exactly_one_branch():
    schema = {"type": "array", "oneOf": [{"$ref": "#/definitions/x"}, {"$ref": "#/definitions/y"}],
              "definitions": {"x": {"enum": [[1], [2, 4]]}, "y": {"enum": [[2, 4], [6], "s"]}}}
    out = rewrite(schema)
    assert out == {"enum": [[1], [6]]}
    _same_verdicts(schema, out, [[1], [2, 4], [6], "s", [], None])


def test_finite_subschema_inside_an_object_keeps_its_annotations_and_the_rest():
    schema = {"type": "object", "properties": {"mode": {"description": "d", "type": "string", "enum": ["a", "b", "c"],
                                                        "not": {"const": "b"}}, "n": {"type": "integer"}},
              "required": ["mode"]}
    out = rewrite(schema)
    assert out["properties"]["mode"] == {"description": "d", "enum": ["a", "c"]}
    assert out["properties"]["n"] == {"type": "integer"} and out["required"] == ["mode"]
    assert list(out) == list(schema)  # key order kept: the grammar writes properties in declared order


def test_plain_enums_are_left_alone_and_ref_siblings_follow_the_draft():
    plain = {"type": "string", "enum": ["a", "b"]}
    assert rewrite(plain) == plain
    # draft 7 ignores keywords beside $ref: the enum here is not a bound on the instances, so it goes
    p = {"$ref": "#/definitions/s", "enum": ["a"], "not": {"const": "b"}, "description": "kept"}
    draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"s": {"type": "string"}},
              "properties": {"p": p}}
    assert rewrite(draft7)["properties"]["p"] == {"$ref": "#/definitions/s", "description": "kept"}
    for instance in ({"p": "b"}, {"p": "zz"}, {"p": 1}):
        assert jsonschema.Draft7Validator(draft7).is_valid(instance) == \
            jsonschema.Draft7Validator(rewrite(draft7)).is_valid(instance)
    # 2020-12 (or no $schema) applies them: left alone
    later = {**draft7, "$schema": "https://json-schema.org/draft/2020-12/schema"}
    assert rewrite(later)["properties"]["p"] == p


@pytest.mark.parametrize("pattern, lo, hi, expected", [
    ("^[a-z]+$", 0, 8, "^[a-z]{1,8}$"),
    (r"^[\w]+$", 3, 15, r"^[\w]{3,15}$"),
    ("^[0-9a-z-]*$", 4, 63, "^[0-9a-z-]{4,63}$"),
    ("^ab[0-9]*c$", 5, None, "^ab[0-9]{2,}c$"),
    ("^[a-f0-9]{8}-[a-f0-9]{4}$", 13, 13, "^[a-f0-9]{8}-[a-f0-9]{4}$"),  # implied by the pattern
    (r"^([\w\/-]|[\w-][\w\/-]*[\w-])$", 0, 255, r"^(?:[\w\/-]|[\w-][\w\/-]{0,253}[\w-])$"),
    ("^(?:ab|c+)$", 3, 4, "^(?:c{3,4})$"),  # "ab" is too short for minLength 3
])
def test_lengths_fold_into_the_pattern(pattern, lo, hi, expected):
    assert bounded_pattern(pattern, lo, hi) == expected
    original = {"type": "string", "pattern": pattern, "minLength": lo, **({} if hi is None else {"maxLength": hi})}
    out = rewrite(original)
    assert out == {"type": "string", "pattern": expected} and first_unenforceable(out) is None
    _same_verdicts(original, out, _strings("abcf0129-_/xZ", 3000, 20) + ["a" * 300, "ab" + "1" * 300 + "c"])


@pytest.mark.parametrize("pattern, lo, hi", [
    ("[a-z]+", 1, 8),  # unanchored: "contains a match", the length is not the match's
    ("^[a-z]+|[0-9]+$", 1, 8),  # a top-level | splits the anchors
    ("^([a-z]+)-([0-9]+)$", 1, 8),  # two parts vary
    ("^[]a]+$", 1, 8),  # [] is an empty class in ECMA, not in Python
    ("^(ab)+$", 1, 8),  # the repeated part is longer than one character
])
def test_lengths_that_do_not_fold_stay_refused(pattern, lo, hi):
    assert bounded_pattern(pattern, lo, hi) is None
    schema = {"type": "string", "pattern": pattern, "minLength": lo, "maxLength": hi}
    assert first_unenforceable(rewrite(schema)) is not None


def test_min_length_zero_is_dropped():
    out = rewrite({"type": "string", "pattern": "[a-z]", "minLength": 0})
    assert out == {"type": "string", "pattern": "[a-z]"}


def test_the_compiler_enforces_what_the_rewrites_carry(tmp_path):
    """Through GrammarCompiler (rewrite, refusal check, compile): the length bound xgrammar ignores
    beside a pattern and the `not` under an enum are enforced by the matcher."""
    from structured.compiler import GrammarCompiler
    from structured.request import StructuredOutput
    from tests.support.tiny import VOCAB, tiny_tokenizer

    compiler = GrammarCompiler(tiny_tokenizer(tmp_path), VOCAB, compile_timeout_s=None)
    schema = {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3},
                                               "mode": {"enum": ["a", "b"], "not": {"const": "b"}}},
              "required": ["id", "mode"]}
    compiled = compiler.compile(StructuredOutput(json_schema=schema))

    def accepts(text: str) -> bool:
        matcher = compiler.new_state(compiled).matcher
        return bool(matcher.accept_string(text) and matcher.is_completed())

    assert accepts('{"id": "abc", "mode": "a"}')
    assert not accepts('{"id": "abcd", "mode": "a"}')
    assert not accepts('{"id": "abc", "mode": "b"}')


def test_an_unsatisfiable_enum_becomes_false():
    """Regression: JSONSchemaBench Github_easy o30275 has string enums under type object. An empty enum
    does not compile in xgrammar, and left as written xgrammar wrote the strings, ignoring the type
    (a leak): the node becomes the false schema, which the compiler refuses with a 400."""
    node = {"enum": ["A", "B"], "readonly": True, "type": "object"}
    assert rewrite({"properties": {"builtin": node}})["properties"]["builtin"] is False
    some = {"enum": ["A", 1], "type": "string"}  # the literals of the wrong type go
    assert rewrite({"properties": {"x": some}})["properties"]["x"] == {"enum": ["A"]}
    fine = {"enum": ["A", "B"], "type": "string"}
    assert rewrite({"properties": {"x": fine}})["properties"]["x"] == fine


@pytest.mark.parametrize("pattern, expected", [
    (r"^$|(^(?:\S+\s+){0,9}\S+$)", r"^(?:(?:\S+\s+){0,9}\S+)?$"),  # "empty or up to ten words"
    ("^a$|^b+$", "^(?:a|b+)$"),
    ("^a|b$", None),  # only the first alternative is anchored at the start: not of the form
    ("^[a|b]$", None),  # the | is inside a class
])
def test_anchored_alternatives_join_under_one_pair_of_anchors(pattern, expected):
    """xgrammar drops ^ and $ inside a regex (structured.schema.support refuses them); ^a$|^b$ is ^(?:a|b)$ exactly."""
    from structured.schema.regex import anchored_alternation

    assert anchored_alternation(pattern) == expected
    if expected is not None:
        import re

        for text in _strings("ab x", 2000, 12) + [""]:
            assert bool(re.search(pattern, text)) == bool(re.search(expected, text)), text
        assert first_unenforceable(rewrite({"type": "string", "pattern": pattern})) is None


@pytest.mark.parametrize("schema, expected", [
    ({"allOf": [{"type": "integer"}, {"minimum": 12}, {"maximum": 14}]},
     {"type": "integer", "minimum": 12, "maximum": 14}),
    ({"allOf": [{"type": "object", "properties": {"foo": {"type": "string"}}, "required": ["foo"]},
                {"type": "object", "properties": {"bar": {"type": "string", "maxLength": 3}}, "required": ["bar"]}]},
     {"type": "object", "properties": {"foo": {"type": "string"}, "bar": {"type": "string", "maxLength": 3}},
      "required": ["foo", "bar"]}),
    ({"allOf": [{"type": "number", "minimum": 0}, {"type": ["integer", "string"], "minimum": 3}]},
     {"type": ["integer"], "minimum": 3}),
    # additionalProperties false on one branch: the other branch's extra property cannot appear
    ({"allOf": [{"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False},
                {"properties": {"d": {"type": "string"}}}]},
     {"type": "object", "properties": {"x": {"type": "integer"}}, "additionalProperties": False}),
    # a property in both branches is the conjunction of its two schemas
    ({"allOf": [{"properties": {"a": {"type": "string", "minLength": 2}}},
                {"properties": {"a": {"maxLength": 5}}}]},
     {"properties": {"a": {"type": "string", "minLength": 2, "maxLength": 5}}}),
])
def test_allof_merges_into_one_schema(schema, expected):
    out = rewrite(schema)
    assert out == expected and first_unenforceable(out) is None
    rng = random.Random(1)
    values = [rng.choice([None, True, 3, 3.5, 13, 20, -1, "ab", "abcdefg", [1], {}]) for _ in range(50)]
    objects = [{k: rng.choice(values) for k in rng.sample(["x", "d", "a", "foo", "bar"], rng.randint(0, 4))}
               for _ in range(400)]
    _same_verdicts(schema, out, values + objects)


@pytest.mark.parametrize("schema", [
    {"allOf": [{"type": "string", "pattern": "^a"}, {"type": "string", "pattern": "b$"}]},  # regex intersection
    {"allOf": [{"properties": {"a": {}}, "additionalProperties": {"type": "integer"}}, {"required": ["b"]}]},
    {"allOf": [{"$ref": "#/$defs/n"}, {"required": ["a"]}],  # recursive: never unfolded
     "$defs": {"n": {"type": "object", "properties": {"child": {"allOf": [{"$ref": "#/$defs/n"}, {}]}}}}},
])
def test_allof_that_does_not_merge_simply_is_left(schema):
    out = rewrite(schema)
    if "$defs" in schema:  # merged once at the top; the recursive child keeps its allOf
        assert out["properties"]["child"] == schema["$defs"]["n"]["properties"]["child"]
    else:  # the allOf stays (its branches may be rewritten on their own: a required name gets declared)
        assert len(out["allOf"]) == len(schema["allOf"])
    assert first_unenforceable(out) is not None
