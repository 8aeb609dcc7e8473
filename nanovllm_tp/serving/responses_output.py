"""A /v1/responses answer as OpenAI's Response object and, streamed, as its semantic server-sent events.

`ResponseWriter` takes the answer's pieces in the order the model writes them (reasoning text, content text,
function calls and their argument pieces) and makes the output items: a `reasoning` item (with a reasoning
parser), a `message` item with one `output_text` part, a `function_call` item per call. A piece of another kind
closes the open item. Streamed and whole answers go through the same writer, so their output items are the same;
streamed, each step is an event, numbered by `sequence_number` from 0:

    response.created, response.in_progress,
    per item: response.output_item.added,
      message:       response.content_part.added, response.output_text.delta..., response.output_text.done,
                     response.content_part.done
      reasoning:     the same with response.reasoning_text.delta / .done
      function_call: response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done,
    then response.completed, response.incomplete (max_output_tokens reached) or response.failed.

An answer with neither text nor calls still has its (empty) message item. Events are `event: TYPE` and `data:
JSON` lines, and the stream ends with the last event (the Responses API has no `data: [DONE]`)."""
import secrets
import time

from nanovllm_tp.sampling_params import SamplingParams
from nanovllm_tp.serving.responses import json_text
from nanovllm_tp.serving.responses_request import ResponsesRequest

TERMINAL = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def new_id(prefix: str) -> str:
    """An id of 128 random bits: a response's id is all a client needs to continue or read it."""
    return f"{prefix}_{secrets.token_hex(16)}"


def response_usage(input_tokens: int, output_tokens: int) -> dict:
    # cached_tokens: the prefix cache's hits are not counted per request; reasoning tokens are not told apart
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


class ResponseWriter:
    def __init__(self, response_id: str, model: str, body: ResponsesRequest, params: SamplingParams,
                 streamed: bool):
        self.id, self.model, self.body, self.params, self.streamed = response_id, model, body, params, streamed
        self.created_at = int(time.time())
        self.items: list[dict] = []          # the output items; the open one is the last
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}     # a tool-call streamer's index -> its function_call item
        self.seq = 0
        self.pending: list[str] = []         # events not yet taken (streamed only)

    # -- the Response object

    def response(self, status: str, usage: dict | None = None, error: dict | None = None) -> dict:
        body = self.body
        fmt = body.text.format if body.text is not None and body.text.format is not None else None
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": self.items if status != "in_progress" else [], "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "reasoning": None, "store": body.store,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": "auto" if choice is None else choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in body.tools or ()], "truncation": "disabled", "usage": usage,
            "user": body.user, "metadata": body.metadata or {},
        }

    # -- events

    def _emit(self, kind: str, **fields) -> None:
        if self.streamed:
            data = json_text({"type": kind, **fields, "sequence_number": self.seq})
            self.pending.append(f"event: {kind}\ndata: {data}\n\n")
        self.seq += 1

    def take(self) -> list[str]:
        """The events written since the last take, as SSE text."""
        out, self.pending = self.pending, []
        return out

    def start(self) -> None:
        self._emit("response.created", response=self.response("in_progress"))
        self._emit("response.in_progress", response=self.response("in_progress"))

    # -- the answer's pieces

    def reasoning(self, text: str) -> None:
        if text:
            self._text_piece("reasoning", text)

    def content(self, text: str) -> None:
        if text:
            self._text_piece("message", text)

    def _text_piece(self, kind: str, text: str) -> None:
        if self.open is None or self.open["type"] != kind:
            self._close("completed")
            self._open_text(kind)
        part = self.open["content"][0]
        part["text"] += text
        where = {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        if kind == "message":
            self._emit("response.output_text.delta", **where, delta=text, logprobs=[])
        else:
            self._emit("response.reasoning_text.delta", **where, delta=text)

    def _open_text(self, kind: str) -> None:
        if kind == "message":
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs"), "type": "reasoning", "status": "in_progress", "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self._add(item)
        self._emit("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                   content_index=0, part=part)
        item["content"].append(dict(part))

    def call(self, index: int, call_id: str, name: str, arguments: str) -> None:
        """A new function call (`index`: the tool-call streamer's numbering), with its arguments so far."""
        self._close("completed")
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}
        self.calls[index] = item
        self._add(item)
        self.call_arguments(index, arguments)

    def call_arguments(self, index: int, piece: str) -> None:
        item = self.calls[index]
        if piece:
            item["arguments"] += piece
            if item is self.open:
                self._emit("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=len(self.items) - 1, delta=piece)

    def _add(self, item: dict) -> None:
        self.items.append(item)
        self.open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1,
                   item={**item, **({"content": []} if "content" in item else {})})

    def _close(self, status: str) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.items) - 1
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            self._emit("response.function_call_arguments.done", **where, name=item["name"],
                       arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                self._emit("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            else:
                self._emit("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            self._emit("response.content_part.done", **where, content_index=0, part=part)
        self._emit("response.output_item.done", output_index=index, item=item)

    # -- the end

    def finish(self, status: str, usage: dict | None, error: dict | None = None) -> dict:
        """The final Response object (`status`: completed, incomplete or failed), after the events that close the
        open item and the terminal event."""
        if not self.items and status != "failed":
            self._open_text("message")                   # an empty answer is an empty message
        self._close("completed" if status == "completed" else "incomplete")
        final = self.response(status, usage, error)
        self._emit(TERMINAL[status], response=final)
        return final

    @property
    def text(self) -> str:
        """The answer's content: its message's text."""
        return "".join(item["content"][0]["text"] for item in self.items if item["type"] == "message")

    @property
    def function_calls(self) -> list[dict]:
        return [item for item in self.items if item["type"] == "function_call"]
