"""bench/guided_json.py: validity as jsonschema judges it, the prompt budget for a schema's text, and one run on
the tiny zoo target where an unenforceable schema is counted as refused and the others are decoded and checked."""
from __future__ import annotations

import json

from bench.guided_json import prompt_for, run, summarize, validate

OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}


def test_validity_is_jsonschemas_with_formats_checked():
    assert validate('{"a": 3}', OBJECT) is None
    assert "required" in validate("{}", OBJECT)
    assert "not JSON" in validate('{"a": ', OBJECT)
    email = {"type": "string", "format": "email"}
    assert validate('"x@example.com"', email) is None and validate('"no at sign"', email) is not None


def test_a_schema_too_long_for_the_budget_is_shown_compact_then_not_at_all(zoo_dir):
    from transformers import AutoTokenizer

    import zoo

    tok = AutoTokenizer.from_pretrained(str(zoo.layout(zoo_dir).target))
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(40)}}
    ids, shown = prompt_for(tok, big, 10**6)
    assert shown == "indented"
    compact, shown = prompt_for(tok, big, len(ids) - 1)
    assert shown == "compact" and len(compact) < len(ids)
    none, shown = prompt_for(tok, big, 8)
    assert shown == "none" and "field_0" not in tok.decode(none)


def test_a_run_refuses_what_it_cannot_enforce_and_checks_the_rest(zoo_dir):
    import zoo
    from engine import LLM

    unenforceable = {"type": "array", "allOf": [{"not": {"items": {"patternProperties": {"ab": False},
                                                                   "additionalProperties": False}}}]}
    cases = [("obj", "S", OBJECT), ("enum", "S", {"enum": ["red", "green"]}), ("odd", "T", unenforceable)]
    llm = LLM(str(zoo.layout(zoo_dir).target), max_num_seqs=4, num_kv_blocks=256, block_size=16)
    rows, seconds = run(llm, cases, 48, 4096)
    by = {r["case"]: r for r in rows}
    assert "cannot be enforced" in by["odd"]["refused"]
    for name in ("obj", "enum"):
        row = by[name]
        assert row["refused"] is None and row["schema_in_prompt"] == "indented" and 0 < row["tokens"] <= 48
        if row["finish"] == "stop":  # completed: the grammar ended, so the instance must validate
            assert row["invalid"] is None, row
    assert json.loads(by["enum"]["text"]) in ("red", "green")  # two tokens' worth: it always completes
    total = summarize(rows)
    assert (total["cases"], total["refused"], total["served"]) == (3, 1, 2) and total["valid"] == total["completed"]
    assert seconds > 0 and not llm.engine.has_unfinished()
