"""/v1/responses' body: OpenAI's Responses API request (with vLLM's extra sampling fields) and its translation into
a /v1/chat/completions body, so that the Responses API runs on the chat path (the same messages through the same
template, the same tools, the same sampling) instead of a second one.

`input` is a string (one user message) or a list of items: messages (roles user, system, developer, assistant;
content a string or input_text / output_text parts, so an earlier answer's output can be sent back), function
calls and their outputs (a chat's assistant tool_calls and tool messages), reasoning items (accepted and left out
of the prompt: chat templates drop earlier turns' thinking). `instructions` is a system message first. A field,
tool, item or content part this server does not implement is refused by name with the reason
(REFUSED_RESPONSE_FIELDS, REFUSED_TOOLS, REFUSED_ITEMS, REFUSED_PARTS), before any other check: nothing a client
sends is ignored."""
from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

from nanovllm_tp.serving.body import Body, Int, Stop, TextBody, TokenKey
from nanovllm_tp.serving.chat_request import ChatCompletionRequest
from nanovllm_tp.utils.checks import did_you_mean

_BUILT_IN = "built-in tools are not implemented on this server: only function tools (type 'function')"
_BACKGROUND = "background responses are not implemented: every response is made while its request waits"
# Top-level fields of OpenAI's Responses API (and vLLM's) that this server does not implement, each refused with a
# 400 that names it and says why.
REFUSED_RESPONSE_FIELDS: dict[str, str] = {
    "background": _BACKGROUND, "background_options": _BACKGROUND,
    "reasoning": "reasoning options are not implemented (a --reasoning-parser server returns a reasoning item "
                 "whatever the request says)",
    "include": "include is not implemented (no output logprobs, no encrypted reasoning, no built-in tool outputs)",
    "top_logprobs": "output logprobs are not implemented on /v1/responses (use /v1/chat/completions)",
    "conversation": "conversation objects are not implemented: continue with previous_response_id",
    "prompt": "prompt templates are not implemented: send input and instructions",
    "context_management": "context management is not implemented",
    "max_tool_calls": "max_tool_calls is not implemented: the model makes its function calls in one answer, and "
                      "built-in tools do not run here",
    "prompt_cache_retention": "prompt_cache_retention is not implemented (the prefix cache keeps blocks while "
                              "memory allows)",
    "prompt_cache_options": "prompt_cache_options is not implemented (the prefix cache needs no hint)",
    "moderation": "moderation is not implemented", "image": "image generation is not implemented",
    "access_programs": "access_programs is not implemented",
    "previous_input_messages": "previous_input_messages (vLLM's harmony field) is not implemented: use "
                               "previous_response_id, or send the messages in input",
    "enable_response_messages": "enable_response_messages is not implemented",
    "chat_template_kwargs": "chat_template_kwargs is not accepted on /v1/responses (use /v1/chat/completions)",
    "cache_salt": "cache_salt is not implemented", "kv_transfer_params": "KV transfer is not implemented",
    "mm_processor_kwargs": "multimodal inputs are not implemented", "media_io_kwargs":
        "multimodal inputs are not implemented", "vllm_xargs": "vllm_xargs is not accepted",
    "request_id": "request ids are the server's to make",
}
REFUSED_TOOLS: dict[str, str] = {kind: _BUILT_IN for kind in (
    "web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11", "file_search",
    "code_interpreter", "computer", "computer_use_preview", "image_generation", "local_shell", "shell",
    "apply_patch", "mcp", "custom", "tool_search", "namespace")}
REFUSED_ITEMS: dict[str, str] = {
    "item_reference": "item references are not implemented: send the items themselves, or previous_response_id",
    "custom_tool_call": _BUILT_IN, "custom_tool_call_output": _BUILT_IN,
    **{kind: _BUILT_IN for kind in (
        "file_search_call", "web_search_call", "computer_call", "computer_call_output", "image_generation_call",
        "code_interpreter_call", "local_shell_call", "local_shell_call_output", "shell_call", "shell_call_output",
        "apply_patch_call", "apply_patch_call_output", "mcp_list_tools", "mcp_approval_request",
        "mcp_approval_response", "mcp_call", "tool_search_call", "tool_search_output", "compaction")}}
REFUSED_PARTS: dict[str, str] = {
    "input_image": "image inputs are not implemented (input_text parts only)",
    "input_file": "file inputs are not implemented (input_text parts only)",
    "input_audio": "audio inputs are not implemented (input_text parts only)",
    "refusal": "refusal parts are not implemented (output_text parts only)",
}


class ContentPart(Body):
    """input_text, or output_text as an earlier answer's message holds it (sent back as input)."""
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, object]] | None = None
    logprobs: list[dict[str, object]] | None = None


def _text_of(content) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


Content = Annotated[Annotated[str, Tag("a string")] | Annotated[list[ContentPart], Tag("text parts")],
                    Discriminator(lambda v: "a string" if isinstance(v, str) else "text parts" if isinstance(v, list)
                                  else None, custom_error_type="content_type",
                                  custom_error_message="must be a string or a list of input_text parts")]


class MessageItem(Body):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Content
    id: str | None = None            # an earlier output message sent back: its id and status mean nothing here
    status: str | None = None


class FunctionCallItem(Body):
    """A function call the model made earlier (an assistant message's tool call, for the template)."""
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Body):
    """The caller's result of a function call (a tool message, for the template)."""
    type: Literal["function_call_output"]
    call_id: str
    output: Content
    id: str | None = None
    status: str | None = None


class ReasoningItem(Body):
    """An earlier answer's reasoning, sent back: left out of the prompt, as chat templates drop earlier thinking."""
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, object]] | None = None
    content: list[dict[str, object]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_kind(value) -> str | None:
    if not isinstance(value, dict):
        return None
    return value.get("type", "message" if "role" in value else None)


Item = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                 | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                 | Annotated[ReasoningItem, Tag("reasoning")],
                 Discriminator(_item_kind, custom_error_type="item_type", custom_error_message="must be a message "
                               "({'role', 'content'}), a function_call, a function_call_output or a reasoning item")]

Input = Annotated[Annotated[str, Tag("a string")] | Annotated[list[Item], Tag("items")],
                  Discriminator(lambda v: "a string" if isinstance(v, str) else "items" if isinstance(v, list)
                                else None, custom_error_type="input_type",
                                custom_error_message="must be a string or a list of input items")]


class FunctionTool(Body):
    """A function tool, flat as the Responses API writes it (chat nests it under `function`)."""
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    """text.format: plain text, any JSON object, or JSON following `schema` (flat, as the Responses API writes
    it; chat nests it under response_format.json_schema)."""
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, object] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ResponseStreamOptions(Body):
    include_obfuscation: bool = True        # accepted, no effect: events carry no obfuscation padding


def _refused(param: str, reason: str) -> PydanticCustomError:
    return PydanticCustomError("refused", "{param}: not supported: {reason}", {"param": param, "reason": reason})


def _ascii(name) -> str:
    """A client's key as it may appear in a message (a lone surrogate escaped: the answer must be valid UTF-8)."""
    return str(name).encode("ascii", "backslashreplace").decode()


class ResponsesRequest(TextBody):
    model: str | None = None
    input: Input
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: ResponseStreamOptions | None = None
    store: bool = True                      # OpenAI's default: the response can be continued (responses_store.py)
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    truncation: Literal["disabled"] | None = None    # "auto" is refused: a prompt must fit max_model_len
    # accepted, and without effect on the output: bookkeeping for OpenAI's own service (metadata and user are
    # echoed in the response)
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extra fields on its ResponsesRequest
    top_k: Int | None = None
    repetition_penalty: float | None = None
    seed: Int | None = None
    stop: Stop | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[TokenKey, float] | None = None
    priority: Int = 0
    structured_outputs: dict[str, object] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data):
        """What this server does not implement, refused by name before anything else is checked (null is absent,
        as everywhere); a top-level field that is not the API's, with the closest one this body declares."""
        if not isinstance(data, dict):
            return data
        for name, value in data.items():
            if value is None:
                continue
            if name in REFUSED_RESPONSE_FIELDS:
                raise _refused(name, REFUSED_RESPONSE_FIELDS[name])
            if name not in cls.model_fields:
                raise PydanticCustomError("extra_field", "{param}: unknown field{hint}",
                                          {"param": _ascii(name), "hint": did_you_mean(name, cls.model_fields)})
        if data.get("truncation") == "auto":
            raise _refused("truncation", "truncation 'auto' is not implemented: a prompt must fit max_model_len "
                                         "('disabled', the default, refuses one that does not)")
        for i, tool in enumerate(data.get("tools") or ()):
            if isinstance(tool, dict) and tool.get("type") in REFUSED_TOOLS:
                raise _refused(f"tools.{i}.type", f"{tool['type']!r}: {REFUSED_TOOLS[tool['type']]}")
        choice = data.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") not in (None, "function"):
            kind = choice["type"]
            raise _refused("tool_choice.type", f"{_ascii(kind)!r}: tool_choice is 'none', 'auto', 'required' or "
                                               "{'type': 'function', 'name': ...} here" if kind not in REFUSED_TOOLS
                           else f"{kind!r}: {_BUILT_IN}")
        items = data.get("input")
        for i, item in enumerate(items if isinstance(items, list) else ()):
            if not isinstance(item, dict):
                continue
            if item.get("type") in REFUSED_ITEMS:
                raise _refused(f"input.{i}.type", f"{item['type']!r} items: {REFUSED_ITEMS[item['type']]}")
            content = item.get("content") if item.get("type", "message") == "message" else item.get("output")
            for j, part in enumerate(content if isinstance(content, list) else ()):
                if isinstance(part, dict) and part.get("type") in REFUSED_PARTS:
                    where = "content" if item.get("type", "message") == "message" else "output"
                    raise _refused(f"input.{i}.{where}.{j}.type", f"{part['type']!r}: {REFUSED_PARTS[part['type']]}")
        return data

    @model_validator(mode="after")
    def _one_format(self):
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return self
        if fmt.type == "json_schema" and fmt.schema_ is None:
            raise PydanticCustomError("format", "text.format: a json_schema format needs its 'schema' object",
                                      {"param": "text.format.schema"})
        others = [name for name, given in (("structured_outputs", self.structured_outputs is not None),
                                           ("tool_choice", self.tools and self.tool_choice not in (None, "auto",
                                                                                                   "none")))
                  if given]
        if others:
            raise PydanticCustomError("format", "text.format and {other} both constrain the output; give one",
                                      {"param": "text.format", "other": others[0]})
        return self

    def input_messages(self) -> list[dict]:
        """`input` as chat messages (ChatMessage's fields): a function call joins the assistant message before it
        (one assistant turn: its text, then its calls), a function call's output is a tool message."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict] = []
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": _text_of(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not messages or messages[-1]["role"] != "assistant":
                    messages.append({"role": "assistant", "content": ""})
                messages[-1].setdefault("tool_calls", []).append(call)
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output)})
        return messages

    def as_chat(self, history: list[dict]) -> ChatCompletionRequest:
        """The /v1/chat/completions body that asks for this response: `instructions` as the first (system)
        message, then `history` (the earlier exchange previous_response_id names, as chat messages), then the
        input; the sampling fields under chat's names. ValueError when there is nothing to answer."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions is not None else []) \
            + history + self.input_messages()
        if not messages:
            raise ValueError("input: no messages to answer (an empty list, and no previous_response_id)")
        fmt = self.text.format if self.text is not None else None
        body = {"messages": messages, "max_tokens": self.max_output_tokens, "stream": self.stream,
                "parallel_tool_calls": self.parallel_tool_calls, "priority": self.priority,
                "ignore_eos": self.ignore_eos, "skip_special_tokens": self.skip_special_tokens,
                "include_stop_str_in_output": self.include_stop_str_in_output,
                **{name: value for name in ("temperature", "top_p", "top_k", "repetition_penalty", "seed", "stop",
                                            "logit_bias", "structured_outputs")
                   if (value := getattr(self, name)) is not None}}
        if self.tools:
            body["tools"] = [t.as_chat_tool() for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else \
                {"type": "function", "function": {"name": self.tool_choice.name}}
        if fmt is not None:
            body["response_format"] = {"type": fmt.type} if fmt.type != "json_schema" else \
                {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                        **({"strict": fmt.strict} if fmt.strict is not None else {})}}
        return ChatCompletionRequest.model_validate(body)


def assistant_message(content: str, calls: list[dict]) -> dict:
    """An answer as the chat message a follow-up's history holds: its text and its function calls
    ({"call_id", "name", "arguments"}, as output items hold them)."""
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    return message

