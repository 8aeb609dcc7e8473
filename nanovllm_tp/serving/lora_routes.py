"""LoRA on the server (HTTP process): the adapters served by name (--lora-modules, then those loaded at run time),
a request's model field resolved to one, /v1/models' entries for them, and vLLM's POST /v1/load_lora_adapter
{"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"} (on with --allow-runtime-lora-updating).
The engine checks each adapter (its directory against the model) before the server names it.

A client's lora_path is held to the operator's rules first (`resolve_lora_path`): absolute, or under --lora-root
when the server has one (a relative path then starts there); the directory and its two files must stay inside the
root (or, without one, inside the directory itself) once every symbolic link is followed. A path that breaks a
rule, is not there or is not an adapter gets one and the same message, which names only what the client sent."""
import itertools
import os

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from nanovllm_tp.lora.peft_dir import CONFIG_FILE, NOT_AN_ADAPTER, WEIGHTS_FILE
from nanovllm_tp.lora.request import MAX_NAME_CHARS
from nanovllm_tp.serving.engine_client import EngineDead
from nanovllm_tp.serving.responses import error_response


class ServedAdapters:
    """name -> [name, lora_int_id, path]; ids are never reused (the engine keys its slots and cache by them).
    `shown`: the path /v1/models gives for an adapter loaded at run time (as its client wrote it)."""

    def __init__(self, loras: list):
        self.by_name = {name: [name, lora_id, path] for name, lora_id, path in loras}
        self.shown: dict[str, str] = {}
        self._ids = itertools.count(max((lora_id for _, lora_id, _ in loras), default=0) + 1)

    def model_entries(self, base: str, max_model_len: int) -> list[dict]:
        return [{"id": name, "object": "model", "created": 0, "owned_by": "nanovllm_tp",
                 "root": self.shown.get(name, path), "parent": base, "max_model_len": max_model_len}
                for name, _, path in self.by_name.values()]


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_lora_path(given: str, root: str | None) -> str:
    """The real directory a client's lora_path names under the server's rules (module docstring); ValueError
    otherwise. Not a check that the directory is an adapter the model can run: the engine does that."""
    if "\0" in given:
        raise ValueError(f"lora_path {given!r}: {NOT_AN_ADAPTER}")
    if root is None and not os.path.isabs(given):
        raise ValueError(f"lora_path must be an absolute path, got {given!r} (the server resolves no relative "
                         "paths; its operator may name a root for them with --lora-root)")
    real_root = None if root is None else os.path.realpath(root)
    path = os.path.realpath(os.path.join(real_root, given) if real_root and not os.path.isabs(given) else given)
    files = [os.path.realpath(os.path.join(path, f)) for f in (CONFIG_FILE, WEIGHTS_FILE)]
    fence = real_root or path
    if not (_inside(path, fence) and all(_inside(f, fence) and os.path.isfile(f) for f in files)):
        raise ValueError(f"lora_path {given!r}: {NOT_AN_ADAPTER}")
    return path


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


def add_lora_routes(app, engine, adapters: ServedAdapters, base_name: str, allowed: bool,
                    lora_root: str | None = None) -> None:
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
        name, given = body["lora_name"], body["lora_path"]
        if len(name) > MAX_NAME_CHARS:
            return error_response(400, f"lora_name has {len(name)} characters; at most {MAX_NAME_CHARS}",
                                  param="lora_name")
        if name in adapters.by_name or name == base_name:
            return error_response(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        try:
            path = resolve_lora_path(given, lora_root)
        except ValueError as exc:
            return error_response(400, str(exc), param="lora_path")
        entry = [name, next(adapters._ids), path]
        try:
            await engine.lora("lora_load", entry)
        except (ValueError, TypeError) as exc:       # the engine's reason, naming the path as the client did
            return error_response(400, str(exc).replace(path, given), param="lora_path")
        except EngineDead as exc:
            return error_response(503, str(exc), "service_unavailable")
        adapters.by_name[name] = entry
        adapters.shown[name] = given
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        if not allowed:
            return refused()
        body = await _body(request, "lora_name")
        if isinstance(body, JSONResponse):
            return body
        entry = adapters.by_name.pop(body["lora_name"], None)
        adapters.shown.pop(body["lora_name"], None)
        if entry is None:
            return error_response(404, f"The lora adapter '{body['lora_name']}' cannot be found.", "not_found_error",
                                  "lora_name")
        try:
            await engine.lora("lora_unload", entry)
        except EngineDead as exc:
            return error_response(503, str(exc), "service_unavailable")
        return PlainTextResponse(f"Success: LoRA adapter '{entry[0]}' removed successfully.")
