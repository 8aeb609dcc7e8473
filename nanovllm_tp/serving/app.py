"""The HTTP layer: FastAPI routes of the OpenAI API over an EngineClient (in the HTTP process). Handlers only
validate, submit and await their requests' outputs; a client that goes away has its requests aborted."""
import asyncio
import contextlib
import hmac
import json
import logging
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm_tp.prompts import render_chat
from nanovllm_tp.serving.engine_client import EngineClient, EngineDead, Overloaded, RequestStream
from nanovllm_tp.serving.metrics import ServingMetrics
from nanovllm_tp.serving.protocol import ChatCompletionRequest, CompletionRequest
from nanovllm_tp.serving.responses import ResponseBuilder, chat_logprobs, completion_logprobs, error_body
from nanovllm_tp.serving.tool_calls import new_call_id

log = logging.getLogger("nanovllm_tp")
VERSION = "0.1.0"


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, kind, status, param), status_code=status)


class ApiKeyCheck:
    """401 for a /v1 request without the key. Plain ASGI: it looks at the request once and then steps aside, so a
    streamed answer's chunks do not pass through it (as they would through an @app.middleware function)."""

    def __init__(self, app, expected: bytes):
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                response = _error(401, "invalid or missing API key (Authorization: Bearer KEY)", "authentication_error")
                return await response(scope, receive, send)
        await self.app(scope, receive, send)


@dataclass(slots=True)
class ServedModel:
    name: str                  # what clients call it
    root: str                  # where it was loaded from
    max_model_len: int
    tokenizer: object          # for chat templates and echo


def build_app(engine: EngineClient, model: ServedModel, api_key: str | None = None) -> FastAPI:
    model_name, tokenizer = model.name, model.tokenizer
    metrics = ServingMetrics(lambda: engine.stats, model_name)
    engine.on_finished = metrics.on_finished

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.close()

    app = FastAPI(title="nanovllm_tp", version=VERSION, lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}" if where else
                      first.get("msg", "invalid request"), "invalid_request_error", where or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        return _error(exc.status_code, str(exc.detail), "not_found_error" if exc.status_code == 404 else "error")

    if api_key is not None:
        app.add_middleware(ApiKeyCheck, expected=f"Bearer {api_key}".encode())

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model")

    async def submit_all(request_id: str, prompts: list, params) -> list[RequestStream]:
        """One engine request per prompt, their streams sharing one `ready` event."""
        streams, ids, ready = [], [], asyncio.Event()
        try:
            for i, prompt in enumerate(prompts):
                ids.append(f"{request_id}-{i}")
                streams.append(await engine.submit(ids[-1], prompt, params, ready))
        except (ValueError, TypeError) as exc:
            _abort(ids[:len(streams)])
            raise ApiError(400, str(exc)) from None
        except Overloaded as exc:
            _abort(ids[:len(streams)])
            raise ApiError(429, str(exc), "rate_limit_error") from None
        except EngineDead as exc:
            raise ApiError(503, str(exc), "service_unavailable") from None
        return streams

    def _abort(ids) -> None:
        for rid in ids:
            engine.abort(rid)

    @app.get("/health")
    async def health():
        if engine.dead:
            return _error(503, engine.dead, "service_unavailable")
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": VERSION}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "nanovllm_tp", "root": model.root,
                                            "max_model_len": model.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        try:
            params, prompts = body.sampling_params(), body.prompts()
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        rid = engine.new_request_id("cmpl")
        streams = await submit_all(rid, prompts, params)
        builder = ResponseBuilder("completion", rid, model_name, params.n)
        top_n = body.logprobs or 0

        def choice(i, out, c, sent):
            prefix = (out.prompt or tokenizer.decode(out.prompt_token_ids)) \
                if body.echo and not sent else ""
            lp = None
            if body.logprobs is not None:
                ids, positions = c.token_ids, c.logprobs or []
                if body.echo and not sent and out.prompt_logprobs is not None:
                    ids, positions = out.prompt_token_ids + ids, out.prompt_logprobs + positions
                lp = completion_logprobs(ids, positions, 0, top_n)
            return builder.choice(i, c, prefix, lp, delta=body.stream)

        if body.stream:
            return _stream(request, streams, builder, body.include_usage, choice, _abort, rid)
        outputs = await _finals(request, streams, lambda: _abort(f"{rid}-{i}" for i in range(len(streams))))
        return builder.response([choice(i, o, c, False) for i, o in enumerate(outputs) for c in o.outputs], outputs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        try:
            tools = body.tool_mode()
            params = body.sampling_params(tools)
            text = render_chat(tokenizer, [m.as_template_message() for m in body.messages],
                               add_generation_prompt=body.add_generation_prompt,
                               chat_template_kwargs=body.chat_template_kwargs, tools=body.template_tools())
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        except Exception as exc:          # the template's own errors (jinja raises its own types)
            raise ApiError(400, f"the chat template failed on these messages: {exc}") from None
        prompt = {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        rid = engine.new_request_id("chatcmpl")
        streams = await submit_all(rid, [prompt], params)
        builder = ResponseBuilder("chat", rid, model_name, params.n)
        top_n = body.top_logprobs or 0
        streamers = {}                  # choice -> its ToolStreamer (streams with tools)

        def choice(i, out, c, sent):
            lp = chat_logprobs(c.token_ids, c.logprobs or [], top_n) if body.logprobs else None
            return builder.choice(i, c, logprobs=lp, delta=body.stream, first=not sent, tools=tool_parts(i, c))

        def tool_parts(i, c) -> tuple | None:
            """(content, tool_calls, whether it made calls) of the answer so far, or None without tools to read."""
            if tools is None or tools.choice == "none":
                return None
            if not body.stream:
                content, calls = tools.parse(c.text)
                return content, [{"id": new_call_id(), "type": "function",
                                  "function": {"name": name, "arguments": args}} for name, args in calls], bool(calls)
            streamer = streamers.setdefault((i, c.index), tools.streamer())
            return *streamer.feed(c.text, c.finish_reason is not None), streamer.called

        if body.stream:
            return _stream(request, streams, builder, body.include_usage, choice, _abort, rid)
        outputs = await _finals(request, streams, lambda: _abort([f"{rid}-0"]))
        return builder.response([choice(i, o, c, True) for i, o in enumerate(outputs) for c in o.outputs], outputs)

    return app


async def _finals(request: Request, streams: list[RequestStream], abort) -> list:
    """The final output of every stream; the requests are aborted if the client goes away meanwhile."""
    ready, finals = streams[0].ready, [None] * len(streams)
    try:
        while not all(s.done for s in streams):
            ready.clear()
            for i, s in enumerate(streams):
                out = s.take()
                finals[i] = out if out is not None else finals[i]
            if all(s.done for s in streams):
                break
            try:
                await asyncio.wait_for(ready.wait(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    abort()
                    raise ApiError(499, "the client closed the connection") from None
    except EngineDead as exc:
        raise ApiError(503, str(exc), "service_unavailable") from None
    return finals


def _stream(request: Request, streams: list[RequestStream], builder: ResponseBuilder, include_usage: bool,
            choice, abort, rid: str) -> StreamingResponse:
    """Server-sent events: a chunk each time any of the streams has news (a stream's outputs not yet sent are
    merged into one chunk), a usage chunk if asked, then [DONE]."""
    async def events():
        ready, finals, started = streams[0].ready, {}, set()
        try:
            while not all(s.done for s in streams):
                ready.clear()
                choices = []
                for i, s in enumerate(streams):
                    try:
                        item = s.take()
                    except EngineDead as exc:
                        yield _sse(error_body(str(exc), "service_unavailable", 503))
                        return
                    if item is None:
                        continue
                    for c in item.outputs:
                        choices.append(choice(i, item, c, (i, c.index) in started))
                        started.add((i, c.index))
                    if item.finished:
                        finals[i] = item
                if choices:
                    yield _sse(builder.chunk(choices))
                if not all(s.done for s in streams):
                    await ready.wait()
            if include_usage:
                yield _sse(builder.chunk([], builder.usage([finals[i] for i in sorted(finals)])))
            yield "data: [DONE]\n\n"
        finally:
            open_ids = [i for i, s in enumerate(streams) if not s.done]
            if open_ids:                     # the client went away (or the engine failed) mid-stream
                abort([f"{rid}-{i}" for i in open_ids])

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
