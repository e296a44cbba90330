"""zoo.schema_gen: every instance it returns satisfies its schema."""
import random

import jsonschema
import pytest

from zoo.schema_gen import generate_instances

SCHEMAS = {
    "object": {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                                 "age": {"type": "integer", "minimum": 18, "maximum": 30}},
               "required": ["email", "age"], "additionalProperties": False},
    "ref": {"definitions": {"pt": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
            "type": "array", "items": {"$ref": "#/definitions/pt"}, "minItems": 2, "maxItems": 4},
    "allof": {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                        {"properties": {"b": {"type": "boolean"}}, "required": ["b"]}]},
    "anyof": {"anyOf": [{"type": "string", "enum": ["red", "green"]}, {"type": "integer", "multipleOf": 5}]},
    "pattern": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
    "types": {"type": ["string", "null"], "maxLength": 5},
    "const": {"const": {"k": [1, 2]}},
    "tuple": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "format": "date"}],
              "items": False, "minItems": 2},
    "exclusive": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_instances_are_valid(name):
    schema = SCHEMAS[name]
    found = generate_instances(schema, random.Random(0), 3)
    assert found, f"no instance for {name}"
    checker = jsonschema.validators.validator_for(schema)(schema, format_checker=jsonschema.FormatChecker())
    for instance in found:
        checker.validate(instance)
    assert len({repr(i) for i in found}) == len(found)


def test_same_seed_same_instances():
    schema = SCHEMAS["object"]
    assert generate_instances(schema, random.Random(7), 3) == generate_instances(schema, random.Random(7), 3)


def test_unsatisfiable_schema_gives_nothing():
    assert generate_instances(False, random.Random(0), 2) == []
    assert generate_instances({"type": "integer", "minimum": 5, "maximum": 1}, random.Random(0), 2) == []
