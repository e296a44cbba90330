"""Client libraries as their users call them, against the served model (issue 32; tests/router/conftest.py's
`served`: the tiny model, and marked slow the real default model): langchain-openai
(`with_structured_output` by json_schema and by function calling, `bind_tools` with a required call,
streaming) and pydantic-ai (tool output, its default, and native output). They judge protocol, not prose.
Each is skipped where its library is not installed (`pip install -e '.[clients]'`). A tool-using agent loop
does not fit the tiny model's 1,024-token context (its tools preamble and calls, in a 384-token vocabulary)."""
from __future__ import annotations

from importlib.util import find_spec
from typing import Literal

import pytest
from pydantic import BaseModel

pytestmark = pytest.mark.ray
if find_spec("langchain_openai") is None and find_spec("pydantic_ai") is None:
    pytest.skip("no client library installed (pip install -e '.[clients]')", allow_module_level=True)


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    legs: Literal[3, 4]


class Weather(BaseModel):
    """The forecast for a city."""
    city: Literal["Paris", "Oslo"]


# ------------------------------------------------------------------------------------------ langchain-openai
def _chat_model(server, **kw):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(model=server.model, base_url=f"{server.base_url}/v1", api_key="none",
                                       temperature=0, max_retries=0, **{"max_tokens": 120, **kw})


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(served, method):
    pet = _chat_model(served).with_structured_output(Pet, method=method).invoke("A pet?")
    assert isinstance(pet, Pet)


def test_langchain_bind_tools_with_a_required_call(served):
    message = _chat_model(served).bind_tools([Weather], tool_choice="required",
                                                    parallel_tool_calls=False).invoke("Weather?")
    (call,) = message.tool_calls
    assert call["name"] == "Weather" and Weather.model_validate(call["args"])


def test_langchain_streaming_equals_invoke(served):
    llm = _chat_model(served, max_tokens=16)
    streamed = "".join(chunk.content for chunk in llm.stream("Hello"))
    assert streamed == llm.invoke("Hello").content


# ------------------------------------------------------------------------------------------------ pydantic-ai
def _agent(server, output_type, max_tokens: int = 120, **kw):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(server.model, provider=OpenAIProvider(base_url=f"{server.base_url}/v1", api_key="none"))
    return Agent(model, output_type=output_type, model_settings={"temperature": 0, "max_tokens": max_tokens}, **kw)


def test_pydantic_ai_tool_output_the_default_mode(served):
    assert isinstance(_agent(served, Pet).run_sync("A pet?").output, Pet)


def test_pydantic_ai_native_output(served):
    NativeOutput = pytest.importorskip("pydantic_ai").NativeOutput

    assert isinstance(_agent(served, NativeOutput(Pet)).run_sync("A pet?").output, Pet)
