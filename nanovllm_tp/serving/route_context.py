"""What the routes of the OpenAI API share in the HTTP process: the served model, and `RouteContext`, the handle
every route file takes (engine client, server config, prompt encoder, adapters, the request log) with the checks and
the submission the endpoints have in common."""
import time
from dataclasses import dataclass, field

from nanovllm_tp.serving.engine_client import EngineClient, EngineDead, Overloaded, RequestStream
from nanovllm_tp.serving.inputs import PromptEncoder
from nanovllm_tp.serving.lora_routes import ServedAdapters
from nanovllm_tp.serving.request_log import RequestLog
from nanovllm_tp.serving.responses import ApiError
from nanovllm_tp.serving.server_config import ServerConfig


def client_of(request) -> str | None:
    """Whom a request comes from, as the tokenizer threads share their turns: its peer's address."""
    return request.client.host if request.client is not None else None


@dataclass(slots=True)
class ServedModel:
    name: str                  # what clients call it
    root: str                  # where it was loaded from
    max_model_len: int
    tokenizer: object          # for chat templates and echo
    loras: list = field(default_factory=list)    # [name, lora_int_id, path] of each adapter served from the start
    chat_template: str | None = None             # --chat-template's text (None: the tokenizer's)
    sampling_defaults: dict = field(default_factory=dict)    # the engine's request defaults (--generation-config)


@dataclass(slots=True)
class RouteContext:
    engine: EngineClient
    model: ServedModel
    config: ServerConfig
    encoder: PromptEncoder
    adapters: ServedAdapters
    requests: RequestLog | None = None           # None: --disable-log-requests

    def check_model(self, name: str | None) -> list | None:
        """The LoRA adapter a request's model field names ([name, id, path]), None for the base model."""
        model_name, by_name = self.model.name, self.adapters.by_name
        if name is None or name == model_name:
            return None
        if name in by_name:
            return by_name[name]
        served = ", ".join(repr(n) for n in (model_name, *by_name))
        raise ApiError(404, f"The model `{name}` does not exist (this server serves {served}).", "not_found_error",
                       "model")

    async def submit_all(self, request_id: str, prompts: list[list[int]], params, priority: int,
                         lora: list | None = None, request=None, texts=None) -> list[RequestStream]:
        """One engine request per prompt (ids `{request_id}-{i}`), queued all or none; the request log's line
        once they are (`request`: the HTTP request, for its route; `texts`: the prompts as written, where text)."""
        started = time.monotonic()
        try:
            streams = await self.engine.submit([f"{request_id}-{i}" for i in range(len(prompts))], prompts, params,
                                               priority, lora)
        except (ValueError, TypeError) as exc:
            raise ApiError(400, str(exc)) from None
        except Overloaded as exc:
            raise ApiError(429, str(exc), "rate_limit_error") from None
        except EngineDead as exc:
            raise ApiError(503, str(exc), "service_unavailable") from None
        if self.requests is not None:
            self.requests.accepted(request_id, request.url.path if request is not None else "?", prompts, params,
                                   texts, started)
            if request is not None:
                request.state.logged_request = request_id     # its end is logged by the request log, not as refused
        return streams

    def tool_mode(self, body):
        """A chat body's ToolMode under the server's --enable-auto-tool-choice and --tool-call-parser."""
        return body.tool_mode(self.config.enable_auto_tool_choice, self.config.tool_call_parser)

    def check_template_kwargs(self, kwargs: dict | None) -> None:
        if "chat_template" in (kwargs or {}) and not self.config.trust_request_chat_template:
            raise ApiError(400, "chat templates sent in requests are refused: this server renders its model's own "
                                "(the operator allows request templates with --trust-request-chat-template)",
                           param="chat_template_kwargs.chat_template")

    def aborter(self, request_id: str, count: int):
        """abort(which=all): aborts the engine requests submit_all made for `request_id` (its client went away,
        or the engine stopped: the request log says which)."""
        engine, requests = self.engine, self.requests

        def abort(which=range(count), failed: str | None = None):
            """`failed`: why the engine could not finish them (else their client went away, unless the engine
            stopped)."""
            if requests is not None:
                why = failed or engine.dead
                if why:
                    requests.failed(request_id, 503, why)
                else:
                    requests.client_gone(request_id)
            engine.abort([f"{request_id}-{i}" for i in which])
        return abort
