"""OpenAI request bodies (pydantic) and their mapping onto SamplingParams, with vLLM's extra fields.

Field types are checked here; ranges are the engine's own validation (SamplingParams), so the HTTP API refuses
exactly what the Python API refuses, with the same message. A body field named as a SamplingParams field is that
field (None: its default); the endpoints set the rest (max_tokens, logprobs, prompt_logprobs, output_kind) from
OpenAI's names.
"""
import json
from dataclasses import fields
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from nanovllm_tp.prompts import is_token_ids
from nanovllm_tp.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from nanovllm_tp.serving.tool_calls import ToolMode

_SET_BY_ENDPOINT = ("max_tokens", "logprobs", "prompt_logprobs", "output_kind")
_FROM_BODY = tuple(f.name for f in fields(SamplingParams) if f.init and f.name not in _SET_BY_ENDPOINT)


class StreamOptions(BaseModel):
    include_usage: bool = False


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object, or json_schema {"name", "schema", "strict"}."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict | None = None


def structured_outputs_of(response_format: ResponseFormat | None, structured_outputs: dict | None,
                          tools: ToolMode | None = None) -> dict | None:
    """The request's structured_outputs (as StructuredOutputsParams' dict) from response_format, vLLM's
    structured_outputs body field, or the schema tool_choice "required" / a named function enforces; at most one
    of them."""
    given = {}
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            given["response_format"] = {"json_object": True}
        else:
            spec = response_format.json_schema or {}
            if not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format json_schema needs a 'schema' object")
            given["response_format"] = {"json": spec["schema"]}
    if structured_outputs is not None:
        given["structured_outputs"] = structured_outputs
    schema = tools.schema() if tools is not None else None
    if schema is not None:
        given[f"tool_choice={tools.choice if tools.choice != 'named' else tools.name!r}"] = {"json": schema}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both constrain the output; give one")
    return next(iter(given.values()), None)


class _Sampling(BaseModel):
    """Fields shared by completions and chat completions."""
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[int, float] | None = None     # token ids as JSON object keys (strings), as OpenAI sends them
    # vLLM's extra fields
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream_interval: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict | None = None          # StructuredOutputsParams' fields: json, regex, choice, ...
    response_format: ResponseFormat | None = None

    def _params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                tools: ToolMode | None = None) -> SamplingParams:
        kw = {name: value for name in _FROM_BODY if (value := getattr(self, name)) is not None}
        kw["structured_outputs"] = structured_outputs_of(self.response_format, self.structured_outputs, tools)
        return SamplingParams(**kw, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


if set(_FROM_BODY) - set(_Sampling.model_fields):      # every knob is the server's too
    raise ImportError(f"SamplingParams fields the request bodies lack: {set(_FROM_BODY) - set(_Sampling.model_fields)}")


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None          # top-N per token (OpenAI allows up to 5; the engine up to 20)
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or is_token_ids(p):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        if self.suffix is not None:
            raise ValueError("suffix is not supported")
        return self._params(self.max_tokens, self.logprobs,
                            (self.logprobs or 0) if self.echo and self.logprobs is not None else None)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None          # a tool's answer: to which call

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content or ""}
        if self.tool_calls:            # templates read the arguments as an object (they write it with tojson)
            message["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except ValueError:
            raise ValueError(f"tool call {call.get('id')!r}: arguments are not valid JSON") from None
    return {**call, "function": function}


class FunctionDef(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def tool_mode(self) -> ToolMode | None:
        """What the tools and tool_choice ask for (None: no tools)."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise ValueError("tool_choice needs tools")
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        choice = self.tool_choice or "auto"
        mode = ToolMode(functions, "named" if isinstance(choice, NamedToolChoice) else choice,
                        parallel=self.parallel_tool_calls)
        if mode.choice == "named":
            mode.name = choice.function.name
            if mode.name not in mode.names:
                raise ValueError(f"tool_choice names {mode.name!r}, which is not among the tools "
                                 f"({', '.join(sorted(mode.names))})")
        return mode

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def sampling_params(self, tools: ToolMode | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(limit, (self.top_logprobs or 0) if self.logprobs else None, None, tools)
