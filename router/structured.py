"""Which structured output a request body asks for, in every spelling clients use, as the engine's
StructuredOutput fields (a dict: it travels in the prefill request's sampling parameters).

Accepted: OpenAI's `response_format` (`text`, `json_object`, `json_schema` with `{name, schema,
strict}`); vLLM's body extra `structured_outputs: {json | regex | choice | grammar | json_object}`;
the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` that vLLM dropped in
0.12 (still sent by existing clients: accepted, never ignored); and SGLang's top-level `regex`,
`json_schema` (an object or its JSON text) and `ebnf`. At most one of them may constrain a
request, tool calls included (router/tools.py: `tools` with a tool_choice other than "none" constrain
the output to calls; chat only, refused on completions rather than ignored). Anything malformed is a
400 naming the parameter; a grammar that does not compile is the engine's 400 (InvalidRequestError
from the prefill side).
"""
from __future__ import annotations

import json

from engine.errors import InvalidRequestError
from router.errors import APIError, invalid
from structured.request import StructuredOutput

_STRUCTURED_OUTPUTS_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                            "json_object": "json_object"}
# Top-level spellings: vLLM's older guided_* and SGLang's regex / json_schema / ebnf.
_LEGACY = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar", "regex": "regex", "json_schema": "json_schema", "ebnf": "grammar"}


def structured_output(body) -> dict | None:
    """StructuredOutput fields for the body (None: unconstrained). Raises APIError (400)."""
    asked: list[tuple[str, dict]] = []
    if not body.chat:
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(body, name) is not None:
                raise invalid(f"{name} (tool calling) is for /v1/chat/completions only", param=name)
    else:
        tools = body.tool_request()
        if tools is not None and tools.constrains:
            asked.append(("tools", {"structural_tag": tools.structural_tag()}))
    if body.response_format is not None:
        fields = _from_response_format(body.response_format)
        if fields is not None:
            asked.append(("response_format", fields))
    if body.structured_outputs is not None:
        asked.append(("structured_outputs", _from_structured_outputs(body.structured_outputs)))
    for name, kind in _LEGACY.items():
        value = getattr(body, name, None)
        if value is not None:
            asked.append((name, {kind: _value(kind, value, name)}))
    if not asked:
        return None
    if len(asked) > 1:
        raise invalid(f"ask for one structured output, not several: {', '.join(n for n, _ in asked)}",
                      param=asked[1][0])
    param, fields = asked[0]
    try:
        so = StructuredOutput(**fields)
        so.canonical_source()  # a schema given as text must parse
    except InvalidRequestError as e:
        raise APIError(400, e.message, e.error_type, param) from None
    return so.to_dict()


def _from_response_format(fmt) -> dict | None:
    if not isinstance(fmt, dict) or "type" not in fmt:
        raise invalid("response_format must be an object with a `type`", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid("response_format json_schema needs `json_schema: {name, schema, strict}` with a schema",
                          param="response_format.json_schema")
        return {"json_schema": _value("json_schema", spec["schema"], "response_format.json_schema.schema")}
    raise invalid(f"unknown response_format type {kind!r}; use text, json_object or json_schema",
                  param="response_format.type")


def _from_structured_outputs(so) -> dict:
    if not isinstance(so, dict):
        raise invalid("structured_outputs must be an object", param="structured_outputs")
    known = {k: v for k, v in so.items() if v is not None and v is not False}
    unknown = set(known) - set(_STRUCTURED_OUTPUTS_KEYS) - {"disable_any_whitespace", "disable_fallback",
                                                             "disable_additional_properties", "whitespace_pattern"}
    if unknown:
        raise invalid(f"unsupported structured_outputs field(s) {sorted(unknown)}; supported: "
                      f"{sorted(_STRUCTURED_OUTPUTS_KEYS)}", param="structured_outputs")
    kinds = [k for k in _STRUCTURED_OUTPUTS_KEYS if k in known]
    if len(kinds) != 1:
        raise invalid(f"structured_outputs needs exactly one of {sorted(_STRUCTURED_OUTPUTS_KEYS)}",
                      param="structured_outputs")
    kind = _STRUCTURED_OUTPUTS_KEYS[kinds[0]]
    if kind == "json_object":
        return {"json_object": True}
    return {kind: _value(kind, known[kinds[0]], f"structured_outputs.{kinds[0]}")}


def _value(kind: str, value, param: str):
    if kind == "json_schema":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise invalid(f"the JSON schema is not valid JSON: {e}", param=param) from None
        if not isinstance(value, dict):
            raise invalid("a JSON schema must be an object", param=param)
        return value
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise invalid("choice must be a non-empty list of non-empty strings", param=param)
        return value
    if not isinstance(value, str) or not value:
        raise invalid(f"{kind} must be a non-empty string", param=param)
    return value
