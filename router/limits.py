"""Request checks the pydantic models cannot express alone: limits that depend on the router's settings or
the model (stop strings, logprobs, token ids, JSON nesting), OpenAI parameters this server does not
implement and every unknown field that may change the output (refused, never silently ignored; only
documented no-op fields are ignored), and text that is not valid Unicode. Each failure is an
APIError (HTTP 400) naming the parameter and what is allowed."""
from __future__ import annotations

from router.config import RouterSettings
from router.errors import invalid

# JSON containers nested deeper than this (in any field: a schema, chat_template_kwargs, an unknown extra)
# are refused: the router would otherwise hand them on to pickle and xgrammar, which recurse.
MAX_JSON_DEPTH = 64

# Fields of the OpenAI (and vLLM / SGLang) APIs this server does not implement, and the values that ask for
# nothing (accepted).
UNSUPPORTED = {
    "best_of": lambda v: v in (None, 1),
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
}
# Fields that change nothing in the output, accepted and ignored: bookkeeping (metadata, store, ...), cache and
# scheduling hints.
NO_OP = frozenset({"metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "request_id",
                   "priority"})


def check_request(body, settings: RouterSettings, vocab_size: int, chat: bool) -> None:
    """Everything about a request body that can be checked before tokenizing. Raises APIError."""
    extra = body.model_extra or {}
    for name, accepted in UNSUPPORTED.items():
        if name in extra and not accepted(extra[name]):
            raise invalid(f"{name} is not supported by this server; leave it out", name)
    for name, value in extra.items():
        if name not in UNSUPPORTED and name not in NO_OP and value is not None:
            # An unknown field may ask for a different output: refused rather than silently ignored.
            raise invalid(f"unknown field {name!r}: this server does not implement it, and it may change the "
                          "output; leave it out", name)
    for name in type(body).model_fields.keys() | extra.keys():
        value = getattr(body, name, None) if name in type(body).model_fields else extra[name]
        if isinstance(value, (dict, list)) and _too_deep(value):
            raise invalid(f"{name} nests deeper than {MAX_JSON_DEPTH} levels of JSON objects and arrays", name)
    if body.stream_options is not None and not body.stream:
        raise invalid("stream_options is only allowed with stream=true", "stream_options")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if len(stops) > settings.max_stop_strings:
        raise invalid(f"at most {settings.max_stop_strings} stop strings are allowed, got {len(stops)}", "stop")
    if any(len(s) > settings.max_stop_string_chars for s in stops):
        raise invalid(f"stop strings may be at most {settings.max_stop_string_chars} characters long", "stop")
    bad = [t for t in body.stop_token_ids or [] if not 0 <= t < vocab_size]
    if bad:
        raise invalid(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    bad = [t for t in body.logit_bias or {} if not (t.isdigit() and int(t) < vocab_size)]
    if bad:
        raise invalid(f"logit_bias keys {bad[:5]} are not token ids in the vocabulary [0, {vocab_size})",
                      "logit_bias")
    if chat:
        _check_chat(body)
    elif isinstance(body.prompt, str):
        check_unicode(body.prompt, "prompt")


def _check_chat(body) -> None:
    if body.max_completion_tokens is not None and body.max_completion_tokens <= 0:
        raise invalid(f"max_completion_tokens must be a positive integer, got {body.max_completion_tokens}",
                      "max_completion_tokens")
    for i, message in enumerate(body.messages):
        if message.content is None and message.role != "assistant":
            raise invalid(f"a {message.role} message needs content (a string or a list of text parts)",
                          f"messages.{i}.content")
        check_unicode(message.text(), f"messages.{i}.content")


def check_unicode(text: str, param: str) -> None:
    """JSON's \\ud800-style escapes can carry lone surrogates, which no tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid(f"{param} is not valid Unicode: a lone surrogate {text[e.start]!r} at character {e.start}",
                      param) from None


def _too_deep(value) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False
