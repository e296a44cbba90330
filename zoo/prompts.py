"""The one prompt template of the zoo: a JSON Schema in, a JSON instance out.

Everything that talks to the zoo models about structured output (the corpus the models train on,
the demo, the tests, the benchmarks, the evaluation) builds its text here, so that they all agree
token for token:

    messages = json_schema_messages(schema)       # chat form, for an OpenAI-style request
    prompt = json_schema_prompt(schema)           # the same, rendered: what the model sees
    document = json_schema_document(schema, x)    # prompt + instance + end token: a training text

`CHAT_TEMPLATE` (stored in tokenizer_config.json) and `render_chat` are the same function in two
languages (Jinja for transformers' `apply_chat_template`, Python here); a test keeps them equal.
"""
from __future__ import annotations

import json
from typing import Any

BOS = "<|bos|>"
END = "<|end|>"  # end of a turn and of a document; the tokenizer's eos token
PAD = "<|pad|>"
ROLES = ("system", "user", "assistant")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
# Order fixes the ids: <|pad|>=0, <|bos|>=1, <|end|>=2, <|system|>=3, <|user|>=4, <|assistant|>=5.
SPECIAL_TOKENS = (PAD, BOS, END) + ROLE_TOKENS

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant') }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

INSTRUCTION = "Reply with a JSON value that satisfies this JSON Schema."


def schema_text(schema: Any) -> str:
    """The schema as the prompt shows it: compact JSON on one line, keys in their given order."""
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


def instance_text(instance: Any) -> str:
    """A JSON instance as the models write it: one line, `", "` and `": "` separators."""
    return json.dumps(instance, ensure_ascii=False)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    """Python twin of CHAT_TEMPLATE."""
    parts = [BOS]
    for message in messages:
        role = message["role"]
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        parts.append(f"<|{role}|>\n{message['content']}{END}\n")
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


def json_schema_messages(schema: Any) -> list[dict[str, str]]:
    """The chat messages that ask for an instance of `schema` (a dict, or a bool schema)."""
    return [{"role": "user", "content": f"{INSTRUCTION}\nSchema: {schema_text(schema)}"}]


def json_schema_prompt(schema: Any) -> str:
    """The rendered prompt (with the assistant header): the text the model continues with JSON."""
    return render_chat(json_schema_messages(schema), add_generation_prompt=True)


def json_schema_document(schema: Any, instance: Any) -> str:
    """A whole training text: the prompt, the instance and the end token."""
    return json_schema_prompt(schema) + instance_text(instance) + END
