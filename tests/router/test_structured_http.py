"""Structured outputs through the served path (router -> prefill compiles and samples the first token
under the grammar -> hand-over carries the request's structured output -> tp=2 decode), with the
unmodified `openai` client: outputs validate and equal the single-process engine's guided output."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.ray

SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", "bird"]}, "ok": {"type": "boolean"}},
          "required": ["kind", "ok"], "additionalProperties": False}
REGEX = "[a-c]{2}-[0-9]{2}"
# minProperties: xgrammar would not enforce it, llguidance does (structured/llguidance.py)
LLG_SCHEMA = {**SCHEMA, "minProperties": 2}


@pytest.fixture(scope="module")
def engine_text(tandem_server):
    """The single-process engine's greedy guided output for a prompt."""
    from engine import LLM, SamplingParams, StructuredOutput

    llm = LLM(tandem_server.model_dir, num_kv_blocks=256)

    def run(prompt: str, **structured) -> str:
        params = SamplingParams(max_tokens=40, temperature=0, structured_output=StructuredOutput(**structured))
        return llm.generate([prompt], params)[0].text

    return run


def test_response_format_json_schema_on_chat_and_completions(tandem_server, engine_text):
    client = tandem_server.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=tandem_server.model, messages=[{"role": "user", "content": "a pet"}],
                                          max_tokens=40, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    assert chat.choices[0].finish_reason == "stop"
    done = client.completions.create(model=tandem_server.model, prompt="The quick brown fox", max_tokens=40,
                                     temperature=0, extra_body={"response_format": fmt})
    assert done.choices[0].text == engine_text("The quick brown fox", json_schema=SCHEMA)
    jsonschema.validate(json.loads(done.choices[0].text), SCHEMA)


def test_a_schema_xgrammar_cannot_enforce_is_served_by_llguidance(tandem_server, engine_text):
    """Served through the disaggregated path by the second backend: the hand-over carries llguidance's
    grammar, the output validates and equals the single-process engine's."""
    client = tandem_server.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": LLG_SCHEMA, "strict": True}}
    chat = client.chat.completions.create(model=tandem_server.model, messages=[{"role": "user", "content": "a pet"}],
                                          max_tokens=40, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(chat.choices[0].message.content), LLG_SCHEMA)
    assert chat.choices[0].finish_reason == "stop"
    done = client.completions.create(model=tandem_server.model, prompt="lazy fox", max_tokens=40, temperature=0,
                                     extra_body={"response_format": fmt})
    assert done.choices[0].text == engine_text("lazy fox", json_schema=LLG_SCHEMA)


def test_vllm_spellings_and_streaming(tandem_server, engine_text):
    client = tandem_server.openai()
    got = client.completions.create(model=tandem_server.model, prompt="lazy dog", max_tokens=40, temperature=0,
                                    extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, got.choices[0].text) and got.choices[0].text == engine_text("lazy dog", regex=REGEX)
    legacy = client.completions.create(model=tandem_server.model, prompt="lazy dog", max_tokens=40, temperature=0.7,
                                       seed=3, extra_body={"guided_choice": ["yes", "no"]})
    assert legacy.choices[0].text in ("yes", "no")
    stream = client.chat.completions.create(model=tandem_server.model, messages=[{"role": "user", "content": "x"}],
                                            max_tokens=40, temperature=0.9, seed=5, stream=True,
                                            response_format={"type": "json_schema",
                                                             "json_schema": {"name": "p", "schema": SCHEMA}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_grammars_compile_on_the_prefill_side_only(tandem_server):
    """A guided request through the disaggregated path: the prefill replica compiles, the decode ranks
    load the compiled grammar from the hand-over and compile nothing (read from /metrics)."""
    from cluster.testing import wait_for
    from deploy.metrics_probe import scrape, worker_value

    client = tandem_server.openai()
    schema = {"type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"]}  # fresh: not cached
    client.completions.create(model=tandem_server.model, prompt="count", max_tokens=20, temperature=0,
                              extra_body={"structured_outputs": {"json": schema}})

    def events() -> dict:
        samples = scrape(httpx.get(f"{tandem_server.base_url}/metrics", timeout=30).text)
        return {(role, e): worker_value({k: v for k, v in samples.items() if ("event", e) in k[1]},
                                        "tandem_grammar_events", role)
                for role in ("prefill", "decode") for e in ("compiles", "deserializations")}

    # stats reach the router at the decode group's next step report: wait for the deserialization
    wait_for(lambda: events()[("decode", "deserializations")] >= 1, timeout_s=60, poll_s=0.5,
             what="the decode replica to report the handed-over grammar")
    seen = events()
    assert seen[("decode", "compiles")] == 0 and seen[("prefill", "compiles")] >= 1


def test_a_grammar_that_does_not_compile_is_a_400_and_the_server_keeps_serving(tandem_server):
    client = tandem_server.openai()
    bad = {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=tandem_server.model, prompt="hi", max_tokens=8,
                                  extra_body={"structured_outputs": {"json": bad}})
    assert "compile" in str(e.value)
    neither = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}}}  # no backend enforces item uniqueness
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=tandem_server.model, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, response_format={"type": "json_schema", "json_schema": {
                                           "name": "n", "schema": neither}})
    assert "'uniqueItems'" in str(e.value) and "llguidance" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=tandem_server.model, prompt="hi", max_tokens=8,
                                  extra_body={"response_format": {"type": "xml"}})
    ok = client.completions.create(model=tandem_server.model, prompt="hi", max_tokens=8, temperature=0,
                                   extra_body={"guided_regex": REGEX})
    assert re.fullmatch(REGEX, ok.choices[0].text)
