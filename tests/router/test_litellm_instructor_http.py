"""litellm and instructor as their users call them, against the served model (issue 32; `served`: the tiny
model, and marked slow the real default model): litellm.completion through its `openai/` provider with an
api_base (whole and streamed, rebuilt by its stream_chunk_builder, tools, a Pydantic response_format) and
instructor.from_openai with a Pydantic response model in its TOOLS, TOOLS_STRICT, JSON_SCHEMA and JSON
modes, whole and as streamed partials. They judge protocol, not prose. Skipped where the library is not
installed (`pip install -e '.[clients]'`)."""
from __future__ import annotations

import json
import os
from importlib.util import find_spec
from typing import Literal

import pytest
from pydantic import BaseModel, ConfigDict

pytestmark = pytest.mark.ray
if find_spec("litellm") is None and find_spec("instructor") is None:
    pytest.skip("neither litellm nor instructor is installed (pip install -e '.[clients]')", allow_module_level=True)
# litellm fetches a price table from GitHub at import unless told to use its bundled copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    legs: Literal[3, 4]


class AnyObject(BaseModel):
    """What a bare json_object response format promises: some JSON object."""
    model_config = ConfigDict(extra="allow")


WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"]}}}
ASK_PET = [{"role": "user", "content": "A pet, as JSON."}]


# ------------------------------------------------------------------------------------------------- litellm
def _litellm(served, **kw):
    litellm = pytest.importorskip("litellm")
    args = dict(model=f"openai/{served.model}", api_base=f"{served.base_url}/v1", api_key="none", temperature=0,
                max_retries=0, **kw)
    whole = litellm.completion(**args)
    chunks = list(litellm.completion(stream=True, stream_options={"include_usage": True}, **args))
    return whole, chunks, litellm.stream_chunk_builder(chunks, messages=args["messages"])


def test_litellm_completion_whole_and_streamed_agree(served):
    whole, chunks, rebuilt = _litellm(served, messages=[{"role": "user", "content": "Hello"}], max_tokens=16)
    text = whole.choices[0].message.content
    assert text and "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert rebuilt.choices[0].message.content == text
    assert rebuilt.choices[0].finish_reason == whole.choices[0].finish_reason in ("stop", "length")
    assert (rebuilt.usage.prompt_tokens, rebuilt.usage.completion_tokens) == (
        whole.usage.prompt_tokens, whole.usage.completion_tokens)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "weather"}}],
                         ids=["required", "named"])
def test_litellm_tool_calls_whole_and_streamed(served, choice):
    whole, _, rebuilt = _litellm(served, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                 tools=[WEATHER], tool_choice=choice, parallel_tool_calls=False, max_tokens=120)
    (call,) = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and call.function.name == "weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert [(c.function.name, c.function.arguments) for c in rebuilt.choices[0].message.tool_calls] == [
        (call.function.name, call.function.arguments)]
    assert rebuilt.choices[0].finish_reason == "tool_calls"


def test_litellm_pydantic_response_format(served):
    whole, _, rebuilt = _litellm(served, messages=ASK_PET, response_format=Pet, max_tokens=120)
    assert whole.choices[0].finish_reason == "stop"
    assert Pet.model_validate_json(whole.choices[0].message.content)
    assert rebuilt.choices[0].message.content == whole.choices[0].message.content


def test_litellm_json_schema_dict_response_format(served):
    schema = {"type": "json_schema", "json_schema": {"name": "pet", "strict": True,
                                                     "schema": Pet.model_json_schema()}}
    whole, _, _ = _litellm(served, messages=ASK_PET, response_format=schema, max_tokens=120)
    assert Pet.model_validate_json(whole.choices[0].message.content)


# ---------------------------------------------------------------------------------------------- instructor
def _instructor(served, mode_name: str):
    instructor = pytest.importorskip("instructor")
    return instructor.from_openai(served.openai(), mode=getattr(instructor.Mode, mode_name))


@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT", "JSON_SCHEMA"])
def test_instructor_response_model(served, mode):
    """max_retries=1: one attempt, no re-asking, so a server that broke the schema fails the test."""
    client = _instructor(served, mode)
    pet, completion = client.chat.completions.create_with_completion(
        model=served.model, messages=ASK_PET, response_model=Pet, temperature=0, max_tokens=120, max_retries=1)
    assert isinstance(pet, Pet)
    assert completion.choices[0].finish_reason in ("stop", "tool_calls") and completion.usage.completion_tokens


def test_instructor_json_mode_gets_a_json_object(served):
    """Mode.JSON sends response_format json_object and the schema as text: the server promises an object, not
    that the model closes it. SmolLM2 under instructor's JSON prompt nests {"json_object": {...}} until
    max_tokens: then instructor's IncompleteOutputException, on a response cut by length whose text is the
    start of a JSON object (jiter's partial parse, instructor's own)."""
    pytest.importorskip("instructor")
    from instructor.core.exceptions import IncompleteOutputException
    from jiter import from_json

    try:
        got = _instructor(served, "JSON").chat.completions.create(
            model=served.model, messages=ASK_PET, response_model=AnyObject, temperature=0, max_tokens=120,
            max_retries=1)
    except IncompleteOutputException as e:
        cut = e.last_completion
        assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 120
        assert isinstance(from_json(cut.choices[0].message.content.encode(), partial_mode="trailing-strings"), dict)
        return
    assert isinstance(got, AnyObject)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_streamed_partials_end_in_the_whole_answer(served, mode):
    client = _instructor(served, mode)
    kw = dict(model=served.model, messages=ASK_PET, response_model=Pet, temperature=0, max_tokens=120, max_retries=1)
    partials = list(client.chat.completions.create_partial(**kw))
    assert partials and partials[-1].model_dump() == client.chat.completions.create(**kw).model_dump()
