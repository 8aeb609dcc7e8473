"""What one request may ask of the server (ServerConfig's limits), checked in the HTTP process before anything
reaches the engine; each refusal names the flag that sets the limit.

- `BodyLimit`: plain ASGI, in front of every route: a body larger than --max-request-body-bytes gets 413 as soon
  as that is known (from Content-Length before a byte is read, else once the bytes read pass the limit), and
  the connection is closed; a body within the limit is read whole here and handed on. After a large body's
  request, the heap's free memory goes back to the system (inputs.release_heap).
- `check_request`: n, prompts and completions per request, stop strings; `check_prompt_count` (embeddings):
  prompts per request.
"""
import asyncio

from fastapi.responses import JSONResponse

from nanovllm_tp.sampling_params import SamplingParams
from nanovllm_tp.serving.inputs import LARGE_INPUT, release_heap
from nanovllm_tp.serving.responses import error_body
from nanovllm_tp.serving.server_config import ServerConfig


def _too_large(limit: int) -> JSONResponse:
    return JSONResponse(error_body(f"the request body is larger than this server takes ({limit} bytes, "
                                   "--max-request-body-bytes)", "invalid_request_error", 413),
                        status_code=413, headers={"connection": "close"})


class BodyLimit:
    def __init__(self, app, limit: int, requests=None):
        """`requests`: the RequestLog that logs each 413 (None: none)."""
        self.app, self.limit, self.requests = app, limit, requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_large(scope)(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return                                  # the client left before its body was in
            size += len(message.get("body", b""))
            if size > self.limit:
                return await self._too_large(scope)(scope, receive, send)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, handed = b"".join(chunks), False

        async def replay():
            nonlocal handed
            if handed:
                return await receive()                  # afterwards: the disconnect, when it comes
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replay, send)
        finally:
            if size >= LARGE_INPUT:       # the body, its JSON and whatever came of them are freed by now
                del body, chunks
                await asyncio.to_thread(release_heap)

    def _too_large(self, scope) -> JSONResponse:
        response = _too_large(self.limit)
        if self.requests is not None:
            self.requests.refused(scope["method"], scope["path"], 413, f"the request body is larger than this "
                                  f"server takes ({self.limit} bytes)")
        return response


def check_prompt_count(config: ServerConfig, num_prompts: int) -> None:
    if num_prompts > config.max_prompts_per_request:
        raise ValueError(f"{num_prompts} prompts in one request; this server takes at most "
                         f"{config.max_prompts_per_request} (--max-prompts-per-request)")


def check_request(config: ServerConfig, params: SamplingParams, num_prompts: int = 1) -> None:
    """ValueError naming the limit a request passes."""
    check_prompt_count(config, num_prompts)
    if params.n > config.max_n:
        raise ValueError(f"n={params.n} is more than this server allows: at most {config.max_n} (--max-n)")
    if num_prompts * params.n > config.max_choices_per_request:
        raise ValueError(f"{num_prompts} prompts x n={params.n} = {num_prompts * params.n} completions; this server "
                         f"makes at most {config.max_choices_per_request} per request (--max-choices-per-request)")
    stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or ())
    if len(stops) > config.max_stop_strings:
        raise ValueError(f"{len(stops)} stop strings; this server takes at most {config.max_stop_strings} "
                         "(--max-stop-strings)")
    longest = max(stops, key=len, default="")
    if len(longest) > config.max_stop_string_chars:
        raise ValueError(f"a stop string of {len(longest)} characters; this server takes at most "
                         f"{config.max_stop_string_chars} (--max-stop-string-chars)")
