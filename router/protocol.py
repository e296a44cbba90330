"""The OpenAI HTTP API's request bodies (pydantic, at the HTTP boundary) and how they become
engine sampling parameters. Response bodies are built as plain dicts in router/responses.py."""
from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr

from router.structured import structured_output
from router.tools import ToolRequest, tool_request


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an option not implemented here is a 400, never ignored
    include_usage: bool = Field(False, description="Send a last chunk with token usage before [DONE].")
    continuous_usage_stats: bool = Field(False, description="vLLM: with include_usage, every chunk carries the "
                                                            "usage so far too.")


class SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    # Unknown fields are kept (router/limits.py refuses the OpenAI ones this server does not implement and
    # ignores the rest); NaN and Infinity, which Python's JSON parser accepts, are refused.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    chat: ClassVar[bool] = False  # tools are chat-only

    model: str = Field(description="The served model's name (see GET /v1/models).")
    max_tokens: int | None = Field(None, description="Most tokens to generate; default 16 (completions) or "
                                                     "what fits the context (chat).")
    temperature: float | None = Field(None, description="Sampling temperature; 0 is greedy. Default 1.")
    top_p: float | None = Field(None, description="Nucleus sampling mass in (0, 1].")
    top_k: int | None = Field(None, description="Sample among the k most likely tokens; -1 or 0 is off.")
    min_p: float | None = Field(None, description="Drop tokens below min_p times the top probability.")
    n: int = Field(1, description="Completions per prompt, sampled independently (with a seed: seed + i for the "
                                  "i-th); they share the prompt's cached blocks. best_of is not supported.")
    stream: bool = Field(False, description="Stream the output as server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options (include_usage).")
    stop: str | list[str] | None = Field(None, description="Up to 4 strings that end the output (excluded).")
    stop_token_ids: list[int] | None = Field(None, description="Token ids that end the output.")
    seed: int | None = Field(None, description="Same seed, same output, whatever else is running.")
    presence_penalty: float | None = Field(None, description="Penalty in [-2, 2] on tokens already present.")
    frequency_penalty: float | None = Field(None, description="Penalty in [-2, 2] scaled by token counts.")
    repetition_penalty: float | None = Field(None, description="Multiplicative penalty (> 0) on seen tokens.")
    cache_salt: str | None = Field(None, description="vLLM's: requests share cached prompt blocks only with requests "
                                                     "of the same salt (tenants isolated from each other's prefixes).")
    ignore_eos: bool = Field(False, description="Keep generating past the end-of-sequence token.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    spaces_between_special_tokens: bool = Field(True, description="vLLM's; the router's fast tokenizers never put "
                                                                  "spaces between special tokens (as vLLM with a "
                                                                  "fast tokenizer), whichever the value.")
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string in the text.")
    min_tokens: int = Field(0, description="vLLM: output tokens before EOS or a stop_token_ids token may end the "
                                           "output (stop strings are not held back).")
    logit_bias: dict[str, float] | None = Field(None, description="Token id -> bias in [-100, 100] added to its "
                                                                  "logit (before grammars and sampling).")
    user: str | None = Field(None, description="An end-user id, for the caller's bookkeeping.")
    # structured outputs (router/structured.py): at most one of these may be set
    response_format: dict | None = Field(None, description="OpenAI: {type: text | json_object | json_schema, "
                                                           "json_schema: {name, schema, strict}}.")
    structured_outputs: dict | None = Field(None, description="vLLM: {json | regex | choice | grammar | "
                                                              "json_object}.")
    guided_json: dict | str | None = Field(None, description="Older vLLM spelling of a JSON schema constraint.")
    guided_regex: str | None = Field(None, description="Older vLLM spelling of a regex constraint.")
    guided_choice: list | None = Field(None, description="Older vLLM spelling of a choice constraint.")
    guided_grammar: str | None = Field(None, description="Older vLLM spelling of an EBNF grammar constraint.")
    regex: str | None = Field(None, description="SGLang: constrain the output to a regex.")
    json_schema: dict | str | None = Field(None, description="SGLang: constrain the output to a JSON schema "
                                                            "(an object or its JSON text).")
    ebnf: str | None = Field(None, description="SGLang: constrain the output to an EBNF grammar.")
    # tool calling (chat only; router/tools.py)
    tools: list | None = Field(None, description="Functions the model may call: [{type: function, function: "
                                                 "{name, description, parameters (JSON schema), strict}}].")
    tool_choice: str | dict | None = Field(None, description="none | auto (default with tools) | required | "
                                                             "{type: function, function: {name}}.")
    parallel_tool_calls: bool | None = Field(None, description="Allow more than one call (default true).")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> dict:
        """Engine SamplingParams fields; the engine validates them (bad values -> HTTP 400)."""
        p: dict = {"max_tokens": max_tokens, "ignore_eos": self.ignore_eos,
                   "skip_special_tokens": self.skip_special_tokens,
                   "include_stop_str_in_output": self.include_stop_str_in_output, "logprobs": logprobs}
        for name in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "cache_salt"):
            value = getattr(self, name)
            if value is not None:
                p[name] = value
        if self.stop is not None:
            p["stop"] = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if self.stop_token_ids:
            p["stop_token_ids"] = list(self.stop_token_ids)
        if self.min_tokens:
            p["min_tokens"] = self.min_tokens
        if self.logit_bias:
            p["logit_bias"] = dict(self.logit_bias)  # SamplingParams checks the ids and the range
        structured = structured_output(self)
        if structured is not None:
            p["structured_output"] = structured
        return p


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="The prompt: text or token ids; a list of them is a batch, choices indexed prompt * n + i.")
    logprobs: int | None = Field(None, description="Return the log-probabilities of the top n tokens (0-20).")
    echo: bool = Field(False, description="Prepend the prompt to the returned text (with logprobs: and its tokens' "
                                          "logprobs, the first token's null).")
    suffix: str | None = Field(None, description="Not supported (must be empty).")

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> dict:
        p = super().sampling_params(max_tokens, logprobs)
        if self.echo and logprobs is not None:
            p["prompt_logprobs"] = logprobs  # the prefill scores the prompt (engine/prompt_logprobs.py)
        return p


class ChatContentPart(BaseModel):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str = Field(description="The text of this part.")


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"] = Field(description="Who speaks.")
    content: str | list[ChatContentPart] | None = Field(None, description="Text, or a list of text parts.")
    name: str | None = Field(None, description="Optional speaker name.")
    tool_calls: list | None = Field(None, description="An assistant's calls: [{id, type: function, function: "
                                                      "{name, arguments}}].")
    tool_call_id: str | None = Field(None, description="A tool message: the id of the call it answers.")

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    chat: ClassVar[bool] = True
    _tools: tuple[ToolRequest | None] | None = PrivateAttr(None)
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, description="Newer name of max_tokens; wins if both are set.")
    logprobs: bool = Field(False, description="Return the log-probability of each output token.")
    top_logprobs: int | None = Field(None, description="With logprobs: also the n most likely tokens (0-20).")
    add_generation_prompt: bool = Field(True, description="End the templated prompt with the assistant's turn.")
    chat_template_kwargs: dict | None = Field(None, description="Extra variables for the chat template.")

    def tool_request(self) -> ToolRequest | None:
        """The validated tools and tool_choice (APIError 400 naming the parameter)."""
        if self._tools is None:
            self._tools = (tool_request(self.tools, self.tool_choice, self.parallel_tool_calls),)
        return self._tools[0]
