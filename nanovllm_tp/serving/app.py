"""The HTTP layer: the FastAPI app of the OpenAI API over an EngineClient (in the HTTP process): its error
handlers, its ASGI guards (API key, body size), the server's own routes (health, version, metrics, models), and the
route files: generate_routes.py (completions, chat), responses_routes.py (the Responses API), prompt_routes.py
(embeddings, tokenize), lora_routes.py.
Handlers only validate (limits.py), tokenize in worker threads (inputs.py), submit and await their requests'
outputs (delivery.py); a client that goes away has every request of its own aborted. Each accepted request, its
end, and each refused one are a line of the request log (request_log.py), unless --disable-log-requests."""
import contextlib
import hmac

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm_tp import __version__
from nanovllm_tp.serving.engine_client import EngineClient
from nanovllm_tp.serving.generate_routes import add_generate_routes
from nanovllm_tp.serving.inputs import PromptEncoder
from nanovllm_tp.serving.limits import BodyLimit
from nanovllm_tp.serving.lora_routes import ServedAdapters, add_lora_routes
from nanovllm_tp.serving.metrics import ServingMetrics
from nanovllm_tp.serving.prompt_routes import add_prompt_routes
from nanovllm_tp.serving.request_log import RequestLog
from nanovllm_tp.serving.responses import (ApiError, FiniteJSONResponse, error_response, is_json, unreadable_body,
                                          validation_message)
from nanovllm_tp.serving.responses_routes import add_responses_routes
from nanovllm_tp.serving.route_context import RouteContext, ServedModel
from nanovllm_tp.serving.server_config import ServerConfig

__all__ = ["build_app", "ServedModel", "ApiError", "VERSION"]
VERSION = __version__


class ApiKeyCheck:
    """401 for a /v1 request without the key. Plain ASGI: it looks at the request once and then steps aside, so a
    streamed answer's chunks do not pass through it (as they would through an @app.middleware function)."""

    def __init__(self, app, expected: bytes, requests: RequestLog | None = None):
        self.app, self.expected, self.requests = app, expected, requests

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                message = "invalid or missing API key (Authorization: Bearer KEY)"
                if self.requests is not None:
                    self.requests.refused(scope["method"], scope["path"], 401, message)
                return await error_response(401, message, "authentication_error")(scope, receive, send)
        await self.app(scope, receive, send)


def build_app(engine: EngineClient, model: ServedModel, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    model_name, tokenizer = model.name, model.tokenizer
    metrics = ServingMetrics(engine.labelled_stats, model_name, engine if hasattr(engine, "router") else None,
                             model.max_model_len)
    requests = RequestLog(config.max_log_len, tokenizer) if config.log_requests else None
    engine.on_finished = metrics.on_finished if requests is None else _both(metrics.on_finished, requests.finished)
    encoder = PromptEncoder(tokenizer, model.max_model_len, chat_template=model.chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        engine.close()
        encoder.close()

    docs = {} if not config.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="nanovllm_tp", version=VERSION, lifespan=lifespan, default_response_class=FiniteJSONResponse,
                  **docs)
    app.state.engine = engine
    app.state.metrics = metrics          # the stats line's token totals (frontend.py)

    def logged(request, status: int, message: str) -> None:
        """The request log's line of an error answer: the end of an accepted request (the engine stopped; a client
        gone is ended by its aborted outputs), else a refusal."""
        if requests is None:
            return
        accepted = getattr(request.state, "logged_request", None)
        if accepted is not None:
            if status != 499:
                requests.failed(accepted, status, message)
        else:
            requests.refused(request.method, request.url.path, status, message)

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        logged(request, exc.status, exc.message)
        return error_response(exc.status, exc.message, exc.kind, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc: RequestValidationError):
        if not is_json(request.headers.get("content-type")):      # FastAPI read the body as bytes, not JSON
            message = ("the body must be JSON, sent with Content-Type: application/json (got "
                       f"{request.headers.get('content-type') or 'no Content-Type'})")
            logged(request, 415, message)
            return error_response(415, message)
        body = exc.body if isinstance(exc.body, (dict, list)) else None
        message, param = validation_message(exc.errors(), body)
        logged(request, 400, message)
        return error_response(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request, exc: StarletteHTTPException):
        message = unreadable_body(exc.__cause__) if exc.status_code == 400 and exc.__cause__ else str(exc.detail)
        kind = "not_found_error" if exc.status_code == 404 else \
            "invalid_request_error" if exc.status_code < 500 else "error"
        logged(request, exc.status_code, message)
        response = error_response(exc.status_code, message, kind)
        response.headers.update(exc.headers or {})       # a 405's Allow
        return response

    app.add_middleware(BodyLimit, limit=config.max_request_body_bytes, requests=requests)
    if config.api_key:                      # outermost: 401 before a body is read
        app.add_middleware(ApiKeyCheck, expected=f"Bearer {config.api_key}".encode(), requests=requests)

    adapters = ServedAdapters(model.loras)
    add_lora_routes(app, engine, adapters, model_name, config.allow_runtime_lora_updating, config.lora_root)
    ctx = RouteContext(engine, model, config, encoder, adapters, requests)

    @app.get("/health")
    async def health():
        if engine.dead:
            return error_response(503, engine.dead, "service_unavailable")
        silent = engine.silent_for()
        if silent > config.engine_iteration_timeout:
            return error_response(503, f"the engine loop has not answered for {silent:.0f} s "
                                       f"(--engine-iteration-timeout {config.engine_iteration_timeout:g})",
                                  "service_unavailable")
        states = getattr(engine, "replica_states", None)
        alive = None if states is None else sum(r["alive"] for r in states())
        if alive is not None and alive < len(engine.replicas):    # data-parallel: some replicas are down
            return JSONResponse({"status": "degraded", "replicas_alive": alive, "replicas": len(engine.replicas),
                                 "down": [r["why"] for r in states() if not r["alive"]]})
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping():
        """SageMaker's health check, which vLLM serves too: /health's answer."""
        return await health()

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

    add_generate_routes(app, ctx)
    add_responses_routes(app, ctx)
    add_prompt_routes(app, ctx)
    return app


def _both(first, second):
    """One on_finished callback that calls two."""
    def finished(out):
        first(out)
        second(out)
    return finished
