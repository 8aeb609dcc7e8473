"""LoRA on the server (HTTP process): the adapters served by name (--lora-modules, then those loaded at run time),
a request's model field resolved to one, /v1/models' entries for them, and vLLM's POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"} (on with --allow-runtime-lora-updating).
The engine checks each adapter (its directory against the model) before the server names it."""
import itertools

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from nanovllm_tp.serving.engine_client import EngineDead
from nanovllm_tp.serving.responses import error_response


class ServedAdapters:
    """name -> [name, lora_int_id, path]; ids are never reused (the engine keys its slots and cache by them)."""

    def __init__(self, loras: list):
        self.by_name = {name: [name, lora_id, path] for name, lora_id, path in loras}
        self._ids = itertools.count(max((lora_id for _, lora_id, _ in loras), default=0) + 1)

    def model_entries(self, base: str, max_model_len: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": 0, "owned_by": "nanovllm_tp", "root": path,
                 "parent": base, "max_model_len": max_model_len} for name, _, path in self.by_name.values()]


async def _body(request: Request, *names: str) -> dict | JSONResponse:
    try:
        body = await request.json()
    except ValueError:
        return error_response(400, "the body must be a JSON object")
    if not isinstance(body, dict):
        return error_response(400, "the body must be a JSON object")
    for name in names:
        if not isinstance(body.get(name), str) or not body[name]:
            return error_response(400, f"{name} must be a non-empty string", param=name)
    return body


def add_lora_routes(app, engine, adapters: ServedAdapters, base_name: str, allowed: bool) -> None:
    def refused():
        return error_response(404, "runtime LoRA updating is off: start the server with "
                                   "--allow-runtime-lora-updating (or NANOVLLM_TP_ALLOW_RUNTIME_LORA_UPDATING=1) and "
                                   "--enable-lora", "not_found_error")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        if not allowed:
            return refused()
        body = await _body(request, "lora_name", "lora_path")
        if isinstance(body, JSONResponse):
            return body
        name = body["lora_name"]
        if name in adapters.by_name or name == base_name:
            return error_response(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        entry = [name, next(adapters._ids), body["lora_path"]]
        try:
            await engine.lora("lora_load", entry)
        except (ValueError, TypeError) as exc:
            return error_response(400, str(exc), param="lora_path")
        except EngineDead as exc:
            return error_response(503, str(exc), "service_unavailable")
        adapters.by_name[name] = entry
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        if not allowed:
            return refused()
        body = await _body(request, "lora_name")
        if isinstance(body, JSONResponse):
            return body
        entry = adapters.by_name.pop(body["lora_name"], None)
        if entry is None:
            return error_response(404, f"The lora adapter '{body['lora_name']}' cannot be found.", "not_found_error",
                                  "lora_name")
        try:
            await engine.lora("lora_unload", entry)
        except EngineDead as exc:
            return error_response(503, str(exc), "service_unavailable")
        return PlainTextResponse(f"Success: LoRA adapter '{entry[0]}' removed successfully.")
