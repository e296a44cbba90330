"""A tool-call grammar in the shape router/tools.py builds: a structural tag for a Hermes-style call of
`weather`, and a finite arguments schema for it."""
from __future__ import annotations

TOOL_SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]}},
               "required": ["city", "days"], "additionalProperties": False}


def call_tag(schema, text_around: bool = False) -> dict:
    """A Hermes-style call of `weather` (router/tools.py builds these shapes from `tools`): exactly one
    call, or (`text_around`) text with at least one call in it."""
    call = {"type": "tag", "begin": '<tool_call>\n{"name": "weather", "arguments": ',
            "content": {"type": "json_schema", "json_schema": schema}, "end": "}\n</tool_call>"}
    if text_around:
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"],
                                                      "tags": [call], "at_least_one": True}}
    return {"type": "structural_tag", "format": call}
