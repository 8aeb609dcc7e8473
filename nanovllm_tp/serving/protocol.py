"""OpenAI request bodies (pydantic) and their mapping onto SamplingParams, with vLLM's extra fields.

A body holds only what is declared here, in the declared JSON types: strict (a bool is not a number, a float is
not an int), every integer within 64 bits and every string valid Unicode, whatever field it is in. A field this
server does not implement is refused by name (REFUSED_FIELDS says why), and so is one it does not know: nothing a
client sends is ignored. Ranges are the engine's own validation (SamplingParams), so the HTTP API refuses exactly
what the Python API refuses, with the same message. A body field named as a SamplingParams field is that field
(absent or null: its default); the endpoints set the rest (max_tokens, logprobs, prompt_logprobs, output_kind) from
OpenAI's names.
"""
import json
from dataclasses import fields
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Strict, Tag, model_validator
from pydantic_core import PydanticCustomError

from nanovllm_tp.prompts import is_token_ids
from nanovllm_tp.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams
from nanovllm_tp.serving.tool_calls import ToolMode

_SET_BY_ENDPOINT = ("max_tokens", "logprobs", "prompt_logprobs", "output_kind")
_FROM_BODY = tuple(f.name for f in fields(SamplingParams) if f.init and f.name not in _SET_BY_ENDPOINT)

_GUIDED = "vLLM's older guided_* fields are not accepted: use structured_outputs (or response_format)"
_FUNCTIONS = "OpenAI's deprecated function calling is not implemented: use tools and tool_choice"
_BEAM = "beam search is not implemented"
_REASONING = "reasoning options are not implemented"
# Fields of the OpenAI and vLLM APIs that this server does not implement, each refused with a 400 that names it and
# says why (a field that is neither declared nor here is refused as unknown). The change that implements one
# deletes its entry and declares the field.
REFUSED_FIELDS: dict[str, str] = {
    "guided_json": _GUIDED, "guided_regex": _GUIDED, "guided_choice": _GUIDED, "guided_grammar": _GUIDED,
    "guided_decoding_backend": _GUIDED, "guided_whitespace_pattern": _GUIDED,
    "functions": _FUNCTIONS, "function_call": _FUNCTIONS,
    "best_of": "best_of is not implemented (n completions come back as sampled, none ranked or dropped)",
    "use_beam_search": _BEAM, "length_penalty": _BEAM, "early_stopping": _BEAM,
    "suffix": "suffix (text after the completion) is not implemented",
    "prompt_logprobs": "prompt logprobs come back only through /v1/completions' echo with logprobs",
    "audio": "only text output is implemented", "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": _REASONING, "include_reasoning": _REASONING, "verbosity": "verbosity is not implemented",
    "web_search_options": "web search is not implemented",
    "truncate_prompt_tokens": "prompt truncation is not implemented: the prompt must fit max_model_len",
    "chat_template": "a request's own chat template is not accepted: the model's is used",
    "continue_final_message": "continue_final_message is not implemented",
    "documents": "documents for the chat template are not implemented",
    "mm_processor_kwargs": "multimodal inputs are not implemented",
    "image_url": "image inputs are not implemented (text parts only)",
    "input_audio": "audio inputs are not implemented (text parts only)",
    "file": "file inputs are not implemented (text parts only)",
    "logits_processors": "custom logits processors are not accepted",
    "return_tokens_as_token_ids": "token ids in place of token text are not implemented",
    "return_token_ids": "token ids in responses are not implemented",
    "spaces_between_special_tokens": "spaces_between_special_tokens is not implemented",
    "add_special_tokens": "add_special_tokens is not implemented (prompts get the tokenizer's default)",
    "cache_salt": "cache_salt is not implemented", "kv_transfer_params": "KV transfer is not implemented",
    "vllm_xargs": "vllm_xargs is not accepted",
}


INT64 = (-2**63, 2**63 - 1)
Int = Annotated[int, Field(ge=INT64[0], le=INT64[1])]     # strict like every field here: no bools, no floats
TokenKey = Annotated[int, Strict(False), Field(ge=INT64[0], le=INT64[1])]    # a token id as a JSON key ("42")


# The members of the string-or-lists unions below, by the shape of a value: errors come from the member a value
# is meant as (not the first one pydantic tried), and these names are left out of an error's field path.
UNION_MEMBERS = ("a string", "strings", "token ids", "token-id lists", "text parts")


def _shape(value) -> str | None:
    if isinstance(value, str):
        return "a string"
    if not isinstance(value, list):
        return None
    first = value[0] if value else ""
    return {list: "token-id lists", dict: "text parts"}.get(type(first)) or \
        ("token ids" if isinstance(first, (int, float)) else "strings")


Prompt = Annotated[
    Annotated[str, Tag("a string")] | Annotated[list[str], Tag("strings")] | Annotated[list[Int], Tag("token ids")]
    | Annotated[list[list[Int]], Tag("token-id lists")],
    Discriminator(_shape, custom_error_type="prompt_type", custom_error_message="must be a string, a list of "
                  "strings, a list of token ids or a list of token-id lists")]


Stop = Annotated[Annotated[str, Tag("a string")] | Annotated[list[str], Tag("strings")],
                 Discriminator(lambda v: "strings" if isinstance(v, list) else "a string" if isinstance(v, str) else
                               None, custom_error_type="stop_type",
                               custom_error_message="must be a string or a list of strings")]


_NO_TEXT = {int, float, bool, type(None)}


def _invalid_text(data) -> tuple[str, int] | None:
    """(path, index) of the first string anywhere in the body (keys too) that is not valid Unicode (a lone
    surrogate from a \\ud800 escape), or None. Iterative: a deeply nested body cannot exhaust the stack; a list of
    numbers (token ids) is passed over at C speed."""
    todo = [((), data)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, dict):
            items = [(k, k) for k in value] + list(value.items())
        elif isinstance(value, list) and not set(map(type, value)) <= _NO_TEXT:
            items = enumerate(value)
        else:
            items = ()
        for key, item in items:
            if isinstance(item, (dict, list)):
                todo.append(((*path, key), item))
            elif isinstance(item, str) and not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as exc:       # the path as ASCII: a key may be the bad string
                    return ".".join(map(str, (*path, key))).encode("ascii", "backslashreplace").decode(), exc.start
    return None


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data):
        """A field sent as null is left out: a declared one takes its default (OpenAI's optional fields are
        nullable), and any other asks for nothing (a message echoed back with its "tool_calls": null)."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class _TextBody(_Body):
    """A request body: every string in it, anywhere, valid Unicode."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        bad = _invalid_text(data)
        if bad is not None:
            raise PydanticCustomError("invalid_unicode", "{param}: not valid Unicode text (a lone surrogate at "
                                      "index {index}); every string must encode as UTF-8",
                                      {"param": bad[0] or "body", "index": bad[1]})
        return data


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    """OpenAI's response_format: text, json_object, or json_schema {"name", "schema", "strict", ...}."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, object] | None = None


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


class _Sampling(_TextBody):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Stop | None = None
    seed: Int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[TokenKey, float] | None = None     # token ids as JSON object keys (strings), as OpenAI sends
    # accepted, and without effect on the output: bookkeeping for OpenAI's own service
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None        # this server's prefix cache needs no hint
    safety_identifier: str | None = None
    # vLLM's extra fields
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream_interval: Int | None = None
    allowed_token_ids: list[Int] | None = None
    priority: Int = 0          # lower first, on a server started with --scheduling-policy priority
    bad_words: list[str] | None = None
    structured_outputs: dict[str, object] | None = None     # StructuredOutputsParams' fields: json, regex, ...
    response_format: ResponseFormat | None = None

    def _params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                tools: ToolMode | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
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
    prompt: Prompt
    max_tokens: Int | None = 16
    logprobs: Int | None = None          # top-N per token (OpenAI allows up to 5; the engine up to 20)
    echo: bool = False

    def prompts(self) -> list:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or is_token_ids(p):
            return [p]
        if not p:
            raise ValueError("prompt is empty")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        return self._params(self.max_tokens, self.logprobs,
                            (self.logprobs or 0) if self.echo and self.logprobs is not None else None)


class TextPart(_Body):
    type: Literal["text"]
    text: str


Content = Annotated[Annotated[str, Tag("a string")] | Annotated[list[TextPart], Tag("text parts")],
                    Discriminator(_shape, custom_error_type="content_type",
                                  custom_error_message="must be a string or a list of text parts")]


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[dict[str, object]] | None = None     # an assistant's earlier calls
    tool_call_id: str | None = None                       # a tool's answer: to which call

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


class FunctionDef(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    logprobs: bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, object] | None = None
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


# every field name a body may hold somewhere (the wording of refusals offers the closest one)
DECLARED_FIELDS = sorted({name for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart,
                                         StreamOptions, ResponseFormat, FunctionDef, ToolDef, NamedToolChoice)
                           for name in m.model_fields})
if set(REFUSED_FIELDS) & set(DECLARED_FIELDS):
    raise ImportError(f"fields both declared and refused: {set(REFUSED_FIELDS) & set(DECLARED_FIELDS)}")
