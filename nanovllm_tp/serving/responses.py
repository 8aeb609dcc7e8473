"""RequestOutputs → OpenAI response bodies and stream chunks (completions and chat completions); the error bodies
and the wording of a refused request."""
import json
import math
import sys
import time

from fastapi.responses import JSONResponse

from nanovllm_tp.outputs import CompletionOutput, RequestOutput
from nanovllm_tp.serving.body import INT64, UNION_MEMBERS
from nanovllm_tp.serving.protocol import DECLARED_FIELDS, REFUSED_FIELDS
from nanovllm_tp.utils.checks import did_you_mean


def _finite(value):
    """value with every non-finite float (NaN, +-inf) as null: JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def json_text(body, separators=None) -> str:
    """body as JSON text: non-finite floats anywhere in it are null (a number that is not one never reaches a
    client, streamed or not)."""
    try:
        return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=separators)
    except ValueError:
        return json.dumps(_finite(body), ensure_ascii=False, allow_nan=False, separators=separators)


class FiniteJSONResponse(JSONResponse):
    """Every JSON answer of the server: as starlette's, but NaN and infinities are null, never an error."""

    def render(self, content) -> bytes:
        return json_text(content, (",", ":")).encode("utf-8")


def json_logprob(value: float) -> float | None:
    """A logprob as the API reports it: -inf (a token its request ruled out) as -9999.0, vLLM's figure; NaN or
    +inf (a broken model or adapter) as null."""
    return max(value, -9999.0) if math.isfinite(value) or value < 0 else None


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, kind: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    return FiniteJSONResponse(error_body(message, kind, status, param), status_code=status)


class ApiError(Exception):
    """A refused request, raised anywhere in a route: the app answers it with its error_response."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _ranked(position: dict, top_n: int) -> list:
    """The position's top-N Logprobs, most likely first (the chosen token is there only if it ranks)."""
    return sorted((lp for lp in position.values() if lp.rank is not None and lp.rank <= top_n),
                  key=lambda lp: lp.rank)


def completion_logprobs(token_ids: list[int], positions: list, text_start: int, top_n: int) -> dict:
    """The completions API's logprobs object for these positions (a None position: the first prompt token)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = text_start
    for t, pos in zip(token_ids, positions):
        if pos is None:
            tokens.append(None), token_lps.append(None), tops.append(None), offsets.append(offset)
            continue
        lp = pos[t]
        tokens.append(lp.decoded_token)
        token_lps.append(json_logprob(lp.logprob))
        tops.append({e.decoded_token: json_logprob(e.logprob) for e in _ranked(pos, top_n)})
        offsets.append(offset)
        offset += len(lp.decoded_token or "")
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: list[int], positions: list, top_n: int) -> dict:
    def entry(lp):
        text = lp.decoded_token or ""
        return {"token": text, "logprob": json_logprob(lp.logprob), "bytes": list(text.encode("utf-8"))}

    content = []
    for t, pos in zip(token_ids, positions):
        tops = [entry(lp) for lp in _ranked(pos, top_n)]
        content.append({**entry(pos[t]), "top_logprobs": tops})
    return {"content": content}


class ResponseBuilder:
    """One API response: its id, creation time and model, and its choices' numbering (prompt i, completion j
    -> choice i * n + j)."""

    def __init__(self, kind: str, request_id: str, model: str, n: int):
        self.kind, self.id, self.model, self.n = kind, request_id, model, n
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, prompt_index: int, c: CompletionOutput, prefix: str = "", logprobs: dict | None = None,
               delta: bool = False, first: bool = False, tools: tuple | None = None, text: str | None = None,
               reasoning: str | None = None) -> dict:
        """One choice; `tools`: (content, tool_calls, whether the answer made calls) of a chat answer read for tool
        calls (serving/tool_calls.py) instead of its text; its finish_reason is then "tool_calls". With a reasoning
        parser (serving/reasoning.py), `text` is the answer's content and `reasoning` its reasoning_content."""
        index = prompt_index * self.n + c.index
        if self.kind == "chat":
            text, calls, called = (c.text if text is None else text, None, False) if tools is None else tools
            finish = "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason
            body = {"index": index, "logprobs": logprobs, "finish_reason": finish, "stop_reason": c.stop_reason}
            if delta and tools is None and reasoning is None:
                body["delta"] = ({"role": "assistant", "content": text} if first else
                                 ({"content": text} if text else {}))
            elif delta:
                body["delta"] = {**({"role": "assistant"} if first else {}), **({"content": text} if text else {}),
                                 **({"reasoning_content": reasoning} if reasoning else {}),
                                 **({"tool_calls": calls} if calls else {})}
            else:
                body["message"] = {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}),
                                   **({"reasoning_content": reasoning} if reasoning is not None else {})}
            return body
        return {"index": index, "text": prefix + c.text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def response(self, choices: list[dict], outputs: list[RequestOutput]) -> dict:
        """The whole answer; a choice the engine ended with an error of its own (finish_reason "abort": its
        structured output's grammar failed while generating) adds an `error` object naming it."""
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        choices.sort(key=lambda ch: ch["index"])
        body = {**self._head(obj), "choices": choices, "usage": self.usage(outputs)}
        failed = [(i * self.n + c.index, c.error) for i, o in enumerate(outputs) for c in o.outputs if c.error]
        if failed:
            body.update(self.failure(failed))
        return body

    @staticmethod
    def failure(failed: list[tuple[int, str]]) -> dict:
        """The error object (vLLM's shape) of choices that ended with an error: [(choice index, why)]."""
        message = "; ".join(f"choice {index}: {why}" for index, why in failed)
        return error_body(message, "invalid_request_error", 400, "structured_outputs")

    def chunk(self, choices: list[dict], usage_body: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {**self._head(obj), "choices": choices}
        if usage_body is not None:
            body["usage"] = usage_body
        return body

    @staticmethod
    def usage(outputs: list[RequestOutput]) -> dict:
        return usage(sum(len(o.prompt_token_ids) for o in outputs),
                     sum(o.metrics.num_generation_tokens for o in outputs if o.metrics is not None))


_NOT_AN_OBJECT = ("model_attributes_type", "model_type", "dict_type")


def _client_path(loc: tuple, body, missing: bool) -> str:
    """An error's location as the client wrote it: the keys and indices that lead into the body. pydantic's
    location also names the member of a union it tried (a tag, a type, a class), which the client never wrote:
    those are left out (a declared member name always; any step that leads nowhere in the body when the body is
    known, but for the last of a missing field)."""
    steps, value, known = [], body, body is not None
    parts = [p for p in loc if p not in UNION_MEMBERS]
    if parts[:1] == ["body"]:
        parts = parts[1:]
    for j, p in enumerate(parts):
        if not known or p == "[key]":        # pydantic's mark of a bad key (the value is fine)
            steps.append(p)
        elif isinstance(value, dict) and p in value:
            steps.append(p)
            value = value[p]
        elif isinstance(value, list) and isinstance(p, int) and not isinstance(p, bool) and 0 <= p < len(value):
            steps.append(p)
            value = value[p]
        elif missing and j == len(parts) - 1 and isinstance(value, dict):     # the field the body lacks
            steps.append(p)
    return ".".join(str(p) for p in steps)


def validation_message(errors: list[dict], body=None) -> tuple[str, str | None]:
    """(message, param) of a refused body, from pydantic's errors: a field that is not declared first (with its
    reason, or the closest declared field), else the first error; `param` is the field's path, as the client
    wrote it (`body`: the parsed body, when there is one)."""
    err = next((e for e in errors if e.get("type") == "extra_forbidden"), errors[0] if errors else {})
    kind, ctx = err.get("type"), err.get("ctx") or {}
    path = _client_path(tuple(err.get("loc", ())), body, kind == "missing")
    if kind == "json_invalid":
        return f"the body is not valid JSON: {ctx.get('error', 'decode error')}", None
    if not path and kind in _NOT_AN_OBJECT:
        return "the body must be a JSON object", None
    if not path and kind == "missing":
        return "the request needs a JSON object body", None
    if kind == "extra_forbidden":
        name = str(err["loc"][-1])
        reason = REFUSED_FIELDS.get(name)
        if reason is not None:
            return f"{path}: not supported: {reason}", path
        if name in DECLARED_FIELDS:
            return f"{path}: not a field here (it is one of another endpoint or object)", path
        return f"{path}: unknown field{did_you_mean(name, DECLARED_FIELDS)}", path
    message = err.get("msg", "invalid request")
    if ctx.get("le") == INT64[1] or ctx.get("ge") == INT64[0]:
        message = "must be an integer in [-2**63, 2**63)"
    if ctx.get("param") is not None:        # errors raised for the whole body name their field themselves
        return message, ctx["param"]
    return (f"{path}: {message}" if path else message), path or None


def is_json(content_type: str | None) -> bool:
    """A Content-Type FastAPI reads as JSON: application/json or application/*+json, with any parameters."""
    media = (content_type or "").split(";")[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def unreadable_body(cause: BaseException) -> str:
    """Why a JSON body could not be read at all (FastAPI's bare "There was an error parsing the body")."""
    if isinstance(cause, RecursionError):
        return "the body is not readable JSON: it is nested too deeply"
    if isinstance(cause, UnicodeDecodeError):
        return "the body is not readable JSON: it is not UTF-8 text"
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return f"the body is not readable JSON: it holds an integer of more than {sys.get_int_max_str_digits()} digits"
    return f"the body is not readable JSON: {cause}"
