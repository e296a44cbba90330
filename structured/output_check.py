"""The last line of enforce-or-refuse (issue 11): a guided output the grammar finished is checked against
what the request asked for before anyone is told it is fine.

The refusal rules (structured/schema/support.py) and the exact rewrites (structured/schema/rewrite.py) are
measured on JSONSchemaBench, not proven: a backend may still accept an instance its schema rejects
(bench/results/structured_faithfulness_cpu.md counts the known ones). So when a json_schema or
json_object output ends because its grammar terminated, the text is validated here with the jsonschema
validator of the schema's own draft, formats asserted (the same judge the benchmarks use). A violation
is the server's failure, not the client's: the router answers it with a 500 naming the keyword, so an
invalid instance is never returned with finish_reason "stop" (router/output.py; it judges tool calls'
arguments the same way, each against its function's parameters). Outputs cut by max_tokens or by a
stop string are what the client asked for and are not judged.
"""
from __future__ import annotations

import json
from collections import OrderedDict
from threading import Lock

import jsonschema

from structured.schema.literals import validator_of

MAX_VALIDATORS = 128  # schemas whose validators are kept (a validator compiles its schema's $refs once)
_validators: OrderedDict[str, object] = OrderedDict()
_lock = Lock()


def _validator(schema_text: str):
    with _lock:
        found = _validators.get(schema_text)
        if found is not None:
            _validators.move_to_end(schema_text)
            return found
    validator = validator_of(json.loads(schema_text))
    with _lock:
        _validators[schema_text] = validator
        while len(_validators) > MAX_VALIDATORS:
            _validators.popitem(last=False)
    return validator


def output_violation(structured: dict | None, text: str) -> str | None:
    """Why `text`, an output its grammar finished, is not what `structured` (StructuredOutput fields, as
    requests carry them) asks for; None when it is, or when the kind is not one judged here."""
    if not structured:
        return None
    schema = structured.get("json_schema")
    if schema is None and not structured.get("json_object"):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"the output is not JSON ({e.msg} at character {e.pos})"
    if schema is None:
        return None if isinstance(value, dict) else "the output is not a JSON object"
    schema_text = schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)
    try:
        error = jsonschema.exceptions.best_match(_validator(schema_text).iter_errors(value))
    except RecursionError:
        return "the output is nested too deeply to validate"
    except Exception:  # noqa: BLE001 - a schema the validator cannot run (a remote $ref): not judged
        return None
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "(root)"
    return f"the output violates the schema's {error.validator!r} at {where}: {error.message[:200]}"
