"""structured/output_check.py: a finished guided output is judged against what its request asked for."""
from __future__ import annotations

import json

from structured.output_check import output_violation

SCHEMA = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "object",
          "properties": {"ip": {"type": "string", "format": "ipv4"}, "n": {"type": "integer", "minimum": 1}},
          "required": ["n"]}


def test_valid_outputs_pass():
    assert output_violation({"json_schema": SCHEMA}, '{"ip": "10.0.0.1", "n": 3}') is None
    assert output_violation({"json_schema": json.dumps(SCHEMA)}, '{"n": 1}') is None  # a schema given as text
    assert output_violation({"json_object": True}, '{"a": [1]}') is None


def test_violations_name_the_keyword_and_the_place():
    why = output_violation({"json_schema": SCHEMA}, '{"n": 0}')
    assert "'minimum'" in why and "at n" in why
    why = output_violation({"json_schema": SCHEMA}, '{"ip": "052.1.1.1", "n": 2}')  # formats are asserted
    assert "'format'" in why and "at ip" in why
    assert "'required'" in output_violation({"json_schema": SCHEMA}, "{}")
    assert "not JSON" in output_violation({"json_schema": SCHEMA}, '{"n": 1')
    assert output_violation({"json_object": True}, "[1]") == "the output is not a JSON object"


def test_kinds_not_judged_here():
    assert output_violation(None, "anything") is None
    assert output_violation({"regex": "[a-z]+"}, "123") is None
    assert output_violation({"choice": ["a"]}, "b") is None
