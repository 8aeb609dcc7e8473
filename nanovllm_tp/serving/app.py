"""The HTTP layer: FastAPI routes of the OpenAI API over an EngineClient (in the HTTP process). Handlers only
validate (limits.py), tokenize in worker threads (inputs.py), submit and await their requests' outputs; a client
that goes away has every request of its own aborted."""
import asyncio
import contextlib
import hmac
import json
import logging
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm_tp.serving.embeddings import EmbeddingRequest, embedding_response
from nanovllm_tp.serving.engine_client import EngineClient, EngineDead, Overloaded, RequestStream
from nanovllm_tp.serving.inputs import PromptEncoder
from nanovllm_tp.serving.limits import BodyLimit, check_prompt_count, check_request
from nanovllm_tp.serving.lora_routes import ServedAdapters, add_lora_routes
from nanovllm_tp.serving.metrics import ServingMetrics
from nanovllm_tp.serving.protocol import ChatCompletionRequest, CompletionRequest
from nanovllm_tp.serving.responses import (ResponseBuilder, chat_logprobs, completion_logprobs, error_body, is_json,
                                           unreadable_body, validation_message)
from nanovllm_tp.serving.reasoning import ThinkSplitter, split_reasoning
from nanovllm_tp.serving.server_config import ServerConfig
from nanovllm_tp.serving.tokenization import (DetokenizeRequest, TokenizeChatRequest, TokenizeRequest,
                                              tokenize_response)
from nanovllm_tp.serving.tool_calls import new_call_id

log = logging.getLogger("nanovllm_tp")
VERSION = "0.1.0"
DISCONNECT_CHECK_S = 0.5     # how often a handler waiting for whole outputs looks for its client


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
    loras: list = field(default_factory=list)    # [name, lora_int_id, path] of each adapter served from the start


def build_app(engine: EngineClient, model: ServedModel, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    model_name, tokenizer = model.name, model.tokenizer
    metrics = ServingMetrics(lambda: engine.stats, model_name)
    engine.on_finished = metrics.on_finished
    encoder = PromptEncoder(tokenizer, model.max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.close()
        encoder.close()

    docs = {} if not config.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="nanovllm_tp", version=VERSION, lifespan=lifespan, **docs)
    app.state.engine = engine

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return _error(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        if not is_json(request.headers.get("content-type")):      # FastAPI read the body as bytes, not JSON
            return _error(415, "the body must be JSON, sent with Content-Type: application/json (got "
                          f"{request.headers.get('content-type') or 'no Content-Type'})", "invalid_request_error")
        message, param = validation_message(exc.errors())
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        message = unreadable_body(exc.__cause__) if exc.status_code == 400 and exc.__cause__ else str(exc.detail)
        kind = "not_found_error" if exc.status_code == 404 else \
            "invalid_request_error" if exc.status_code < 500 else "error"
        response = _error(exc.status_code, message, kind)
        response.headers.update(exc.headers or {})       # a 405's Allow
        return response

    app.add_middleware(BodyLimit, limit=config.max_request_body_bytes)
    if config.api_key:                      # outermost: 401 before a body is read
        app.add_middleware(ApiKeyCheck, expected=f"Bearer {config.api_key}".encode())

    adapters = ServedAdapters(model.loras)
    add_lora_routes(app, engine, adapters, model_name, config.allow_runtime_lora_updating)

    def check_model(name: str | None) -> list | None:
        """The LoRA adapter a request's model field names ([name, id, path]), None for the base model."""
        if name is None or name == model_name:
            return None
        if name in adapters.by_name:
            return adapters.by_name[name]
        served = ", ".join(repr(n) for n in (model_name, *adapters.by_name))
        raise ApiError(404, f"The model `{name}` does not exist (this server serves {served}).", "not_found_error",
                       "model")

    async def submit_all(request_id: str, prompts: list[list[int]], params, priority: int,
                         lora: list | None = None) -> list[RequestStream]:
        """One engine request per prompt (ids `{request_id}-{i}`), queued all or none."""
        try:
            return await engine.submit([f"{request_id}-{i}" for i in range(len(prompts))], prompts, params,
                                       priority, lora)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        except Overloaded as exc:
            raise ApiError(429, str(exc), "rate_limit_error") from None
        except EngineDead as exc:
            raise ApiError(503, str(exc), "service_unavailable") from None

    def check_template_kwargs(kwargs: dict | None) -> None:
        if "chat_template" in (kwargs or {}) and not config.trust_request_chat_template:
            raise ApiError(400, "chat templates sent in requests are refused: this server renders its model's own "
                                "(the operator allows request templates with --trust-request-chat-template)",
                           param="chat_template_kwargs.chat_template")

    def aborter(request_id: str, count: int):
        return lambda which=range(count): engine.abort([f"{request_id}-{i}" for i in which])

    @app.get("/health")
    async def health():
        if engine.dead:
            return _error(503, engine.dead, "service_unavailable")
        silent = engine.silent_for()
        if silent > config.engine_iteration_timeout:
            return _error(503, f"the engine loop has not answered for {silent:.0f} s (--engine-iteration-timeout "
                               f"{config.engine_iteration_timeout:g})", "service_unavailable")
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
                                            "owned_by": "nanovllm_tp", "root": model.root, "parent": None,
                                            "max_model_len": model.max_model_len},
                                           *adapters.model_entries(model_name, model.max_model_len)]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        lora = check_model(body.model)
        try:
            params, prompts = body.sampling_params(), body.prompts()
            check_request(config, params, len(prompts))
            encoded = await encoder.completions(prompts)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        rid = engine.new_request_id("cmpl")
        streams = await submit_all(rid, [ids for _, ids in encoded], params, body.priority, lora)
        builder = ResponseBuilder("completion", rid, lora[0] if lora else model_name, params.n)
        top_n = body.logprobs or 0

        def choice(i, out, c, sent):
            text = encoded[i][0]
            prefix = (text if text is not None else tokenizer.decode(out.prompt_token_ids)) \
                if body.echo and not sent else ""
            lp = None
            if body.logprobs is not None:
                ids, positions = c.token_ids, c.logprobs or []
                if body.echo and not sent and out.prompt_logprobs is not None:
                    ids, positions = out.prompt_token_ids + ids, out.prompt_logprobs + positions
                lp = completion_logprobs(ids, positions, 0, top_n)
            return builder.choice(i, c, prefix, lp, delta=body.stream)

        if body.stream:
            return _stream(streams, builder, body.include_usage, choice, aborter(rid, len(streams)))
        outputs = await _finals(request, streams, aborter(rid, len(streams)))
        return builder.response([choice(i, o, c, False) for i, o in enumerate(outputs) for c in o.outputs], outputs)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        lora = check_model(body.model)
        check_template_kwargs(body.chat_template_kwargs)
        try:
            tools = body.tool_mode()
            params = body.sampling_params(tools)
            check_request(config, params)
            prompt = await encoder.chat([m.as_template_message() for m in body.messages],
                                        body.add_generation_prompt, body.chat_template_kwargs, body.template_tools())
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        except Exception as exc:          # the template's own errors (jinja raises its own types)
            raise ApiError(400, f"the chat template failed on these messages: {exc}") from None
        rid = engine.new_request_id("chatcmpl")
        streams = await submit_all(rid, [prompt], params, body.priority, lora)
        builder = ResponseBuilder("chat", rid, lora[0] if lora else model_name, params.n)
        top_n = body.top_logprobs or 0
        streamers, splitters = {}, {}   # choice -> its ToolStreamer / ThinkSplitter (streams with tools / reasoning)

        def choice(i, out, c, sent):
            lp = chat_logprobs(c.token_ids, c.logprobs or [], top_n) if body.logprobs else None
            reasoning, text = reasoning_parts(i, c)
            return builder.choice(i, c, logprobs=lp, delta=body.stream, first=not sent, tools=tool_parts(i, c, text),
                                  text=text, reasoning=reasoning)

        def reasoning_parts(i, c) -> tuple[str | None, str]:
            """(reasoning, content) of the answer (so far, streamed); (None, its text) without a reasoning parser."""
            if config.reasoning_parser is None:
                return None, c.text
            if not body.stream:
                reasoning, content = split_reasoning(config.reasoning_parser, c.text)
                return reasoning, content or ""
            splitter = splitters.setdefault((i, c.index), ThinkSplitter.of(config.reasoning_parser))
            return splitter.feed(c.text, c.finish_reason is not None)

        def tool_parts(i, c, text: str) -> tuple | None:
            """(content, tool_calls, whether it made calls) of the answer's content so far, or None without tools to
            read."""
            if tools is None or tools.choice == "none":
                return None
            if not body.stream:
                content, calls = tools.parse(text)
                return content, [{"id": new_call_id(), "type": "function",
                                  "function": {"name": name, "arguments": args}} for name, args in calls], bool(calls)
            streamer = streamers.setdefault((i, c.index), tools.streamer())
            return *streamer.feed(text, c.finish_reason is not None), streamer.called

        if body.stream:
            return _stream(streams, builder, body.include_usage, choice, aborter(rid, 1))
        outputs = await _finals(request, streams, aborter(rid, 1))
        return builder.response([choice(i, o, c, True) for i, o in enumerate(outputs) for c in o.outputs], outputs)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        if check_model(body.model) is not None:
            raise ApiError(400, f"embeddings come from the base model ({model_name!r}), not from a LoRA adapter")
        try:
            params, prompts = body.pooling_params(), body.prompts()
            check_prompt_count(config, len(prompts))
            encoded = await encoder.completions(prompts, params)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        rid = engine.new_request_id("embd")
        streams = await submit_all(rid, [ids for _, ids in encoded], params, body.priority)
        outputs = await _finals(request, streams, aborter(rid, len(streams)))
        return embedding_response(outputs, model_name, body.encoding_format)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if isinstance(body, TokenizeChatRequest):
            check_template_kwargs(body.chat_template_kwargs)
        try:
            ids = await encoder.run(body.token_ids, tokenizer)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        except Exception as exc:          # the template's own errors
            raise ApiError(400, f"the chat template failed on these messages: {exc}") from None
        return tokenize_response(ids, tokenizer, model.max_model_len, body.return_token_strs)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        try:
            return {"prompt": await encoder.run(body.text, tokenizer)}
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc), param="tokens") from None

    return app


async def _finals(request: Request, streams: list[RequestStream], abort) -> list:
    """The final output of every stream; every request is aborted if the client goes away meanwhile (looked for
    every DISCONNECT_CHECK_S, however busy the streams are)."""
    ready, finals = streams[0].ready, [None] * len(streams)
    next_check = time.monotonic() + DISCONNECT_CHECK_S
    try:
        while not all(s.done for s in streams):
            for i, s in enumerate(streams):
                out = s.take()
                finals[i] = out if out is not None else finals[i]
            if all(s.done for s in streams):
                break
            ready.clear()
            if not any(s.has_news for s in streams):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(ready.wait(), timeout=max(0.0, next_check - time.monotonic()))
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + DISCONNECT_CHECK_S
                if await request.is_disconnected():
                    abort()
                    raise ApiError(499, "the client closed the connection") from None
    except EngineDead as exc:
        raise ApiError(503, str(exc), "service_unavailable") from None
    return finals


def _stream(streams: list[RequestStream], builder: ResponseBuilder, include_usage: bool, choice,
            abort) -> StreamingResponse:
    """Server-sent events: a chunk each time any of the streams has news (a stream's outputs not yet sent are
    merged into one chunk), a usage chunk if asked, then [DONE]."""
    async def events():
        ready, finals, started = streams[0].ready, {}, set()
        try:
            while not all(s.done for s in streams):
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
                ready.clear()
                if not all(s.done for s in streams) and not any(s.has_news for s in streams):
                    await ready.wait()
            if include_usage:
                yield _sse(builder.chunk([], builder.usage([finals[i] for i in sorted(finals)])))
            yield "data: [DONE]\n\n"
        finally:
            open_ids = [i for i, s in enumerate(streams) if not s.done]
            if open_ids:                     # the client went away (or the engine failed) mid-stream
                abort(open_ids)

    return StreamingResponse(events(), media_type="text/event-stream")


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
