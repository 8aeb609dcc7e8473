"""/v1/chat/completions' body: messages (text parts joined; an assistant's earlier tool calls and a tool's answers
as chat templates read them), OpenAI's function tools and tool_choice, and its mapping onto SamplingParams."""
import json
from typing import Annotated, Literal

from pydantic import Discriminator, Field, Tag

from nanovllm_tp.sampling_params import SamplingParams
from nanovllm_tp.serving.body import Body, Int, shape_of
from nanovllm_tp.serving.completion_request import SamplingFields
from nanovllm_tp.serving.tool_calls import ToolMode


class TextPart(Body):
    type: Literal["text"]
    text: str


Content = Annotated[Annotated[str, Tag("a string")] | Annotated[list[TextPart], Tag("text parts")],
                    Discriminator(shape_of, custom_error_type="content_type",
                                  custom_error_message="must be a string or a list of text parts")]


class ChatMessage(Body):
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


class FunctionDef(Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, object] | None = None
    strict: bool | None = None


class ToolDef(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
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

    def tool_mode(self, auto: bool = True, parser: str | None = None) -> ToolMode | None:
        """What the tools and tool_choice ask for (None: no tools). `auto`: whether tool_choice "auto" (the default
        with tools) is served (--enable-auto-tool-choice); `parser`: the format it reads (--tool-call-parser)."""
        if not self.tools:
            if self.tool_choice not in (None, "none"):
                raise ValueError("tool_choice needs tools")
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        seen = set()
        for f in functions:
            if f["name"] in seen:
                raise ValueError(f"tools: the name {f['name']!r} is given to more than one tool; each tool needs a "
                                 "name of its own")
            seen.add(f["name"])
        choice = self.tool_choice or "auto"
        if choice == "auto" and not auto:
            raise ValueError('"auto" tool choice (the default with tools) needs a server started with '
                             '--enable-auto-tool-choice; this one was started with --no-enable-auto-tool-choice: '
                             'send tool_choice "none", "required" or a named function')
        mode = ToolMode(functions, "named" if isinstance(choice, NamedToolChoice) else choice,
                        parallel=self.parallel_tool_calls, parser=parser)
        if mode.choice == "named":
            mode.name = choice.function.name
            if mode.name not in mode.names:
                raise ValueError(f"tool_choice names {mode.name!r}, which is not among the tools "
                                 f"({', '.join(sorted(mode.names))})")
        return mode

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def sampling_params(self, tools: ToolMode | None = None, defaults: dict | None = None) -> SamplingParams:
        """`defaults`: the engine's request defaults (--generation-config) for the fields the body leaves unset."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.top_logprobs is not None and self.top_logprobs < 0:      # the engine's max_logprobs bounds it
            raise ValueError(f"top_logprobs must be >= 0, got {self.top_logprobs}")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if limit is None:
            limit = (defaults or {}).get("max_tokens")
        return self._params(limit, (self.top_logprobs or 0) if self.logprobs else None, None, tools, defaults)
