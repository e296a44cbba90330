"""n > 1 and batched prompts over HTTP (issue 34 item 4), through the official `openai` client against the
session's server (router -> prefill -> hand-over -> decode group): every choice equals the request that
asks for it alone (n = 1, seed + i), streamed and whole responses agree, usage counts each prompt once,
guided choices each satisfy their schema, and no KV block is left behind."""
from __future__ import annotations

import json

import jsonschema
import pytest

from deploy.testing import wait_decode_settled

pytestmark = pytest.mark.ray

# A choice left waiting for a replica (Serve's routing by request id, router/choices.py) hangs its response:
# fail in minutes, not at the client's default of ten.
TIMEOUT_S = 180

SAMPLED = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def _alone(client, model, prompt, seed):
    return client.completions.create(model=model, prompt=prompt, seed=seed, **SAMPLED).choices[0].text


def test_n_samples_equal_the_requests_that_ask_for_each_alone(tandem_server):
    client, model = tandem_server.openai(timeout=TIMEOUT_S), tandem_server.model
    got = client.completions.create(model=model, prompt="The quick brown fox", n=3, seed=11, **SAMPLED)
    assert [c.index for c in got.choices] == [0, 1, 2]
    texts = [c.text for c in got.choices]
    assert texts == [_alone(client, model, "The quick brown fox", 11 + i) for i in range(3)]
    assert len(set(texts)) > 1, "three seeds sampled the same 12 tokens: the children share one seed stream"
    prompt_tokens = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=1).usage.prompt_tokens
    assert got.usage.prompt_tokens == prompt_tokens  # the prompt counted once
    assert got.usage.completion_tokens == 3 * 12
    again = client.completions.create(model=model, prompt="The quick brown fox", n=3, seed=11, **SAMPLED)
    assert [c.text for c in again.choices] == texts  # same request, same seed: same n outputs
    wait_decode_settled(tandem_server.app)


@pytest.mark.parametrize("prompts", [["Hello, how are you?", "lazy dog"], [[5, 9, 22, 41, 8], [120, 7, 3]]],
                         ids=["strings", "token-lists"])
def test_batched_prompts_times_n_are_indexed_prompt_major(tandem_server, prompts):
    client, model = tandem_server.openai(timeout=TIMEOUT_S), tandem_server.model
    got = client.completions.create(model=model, prompt=prompts, n=2, seed=3, echo=True, **SAMPLED)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    for p, prompt in enumerate(prompts):
        for i in range(2):
            alone = client.completions.create(model=model, prompt=prompt, seed=3 + i, echo=True, **SAMPLED)
            assert got.choices[p * 2 + i].text == alone.choices[0].text
    one = [client.completions.create(model=model, prompt=p, max_tokens=1).usage.prompt_tokens for p in prompts]
    assert got.usage.prompt_tokens == sum(one)
    assert got.usage.completion_tokens == 4 * 12


def test_streamed_choices_put_together_equal_the_whole_response(tandem_server):
    client, model = tandem_server.openai(timeout=TIMEOUT_S), tandem_server.model
    messages = [{"role": "user", "content": "Write a line about the sea."}]
    whole = client.chat.completions.create(model=model, messages=messages, n=3, seed=5, temperature=1.0,
                                           max_tokens=10)
    texts, finish, usage = {}, {}, None
    for chunk in client.chat.completions.create(model=model, messages=messages, n=3, seed=5, temperature=1.0,
                                                max_tokens=10, stream=True, stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason is not None:
                assert c.index not in finish, "a choice finished twice"
                finish[c.index] = c.finish_reason
    assert sorted(texts) == [0, 1, 2] and sorted(finish) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c.message.content for c in whole.choices]
    assert [finish[i] for i in range(3)] == [c.finish_reason for c in whole.choices]
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_every_guided_choice_satisfies_its_schema(tandem_server):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    got = tandem_server.openai(timeout=TIMEOUT_S).chat.completions.create(
        model=tandem_server.model, messages=[{"role": "user", "content": "A person as JSON."}], n=3, seed=2,
        temperature=1.0, max_tokens=60,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}})
    assert len(got.choices) == 3
    for c in got.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), schema)


def test_a_stop_string_ends_only_its_own_choice(tandem_server):
    """Each choice's stop strings, detokenizer and cancellation are its own: one choice cut by a stop string
    does not end its siblings, and every choice is what it would be alone."""
    client, model = tandem_server.openai(timeout=TIMEOUT_S), tandem_server.model
    alone = [_alone(client, model, "def add(a, b):", 40 + i) for i in range(4)]
    stop = next((t[2:4] for t in alone if len(t) > 4), None)
    assert stop, alone
    got = client.completions.create(model=model, prompt="def add(a, b):", n=4, seed=40, stop=[stop], **SAMPLED)
    for c, text in zip(got.choices, alone):
        cut = text.find(stop)
        assert c.text == (text if cut < 0 else text[:cut])
        assert c.finish_reason == ("length" if cut < 0 else "stop")
    wait_decode_settled(tandem_server.app)
