"""The HTTP process's handle on the engine loop (serving/engine_loop.py, in rank 0's process).

Handlers submit requests and read a RequestStream each; one task receives the engine's messages and hands each
step's outputs to their streams. A stream holds one output: a delta output its reader has not taken yet is
merged with the next, so a client slower than the engine gets fewer, larger chunks instead of a backlog, and
serving costs less per token as the load grows.
"""
import asyncio
import itertools
import logging

import zmq
import zmq.asyncio

from nanovllm_tp.outputs import RequestOutput, merge_delta
from nanovllm_tp.sampling_params import RequestOutputKind, SamplingParams
from nanovllm_tp.serving import wire

log = logging.getLogger("nanovllm_tp")
_ERRORS = {"ValueError": ValueError, "TypeError": TypeError}


class EngineDead(RuntimeError):
    """The engine stopped (closed or failed): no request can be served any more."""


class Overloaded(RuntimeError):
    """Too many requests wait already."""


class RequestStream:
    """One request's outputs as its handler reads them. `ready` is set whenever there is something to read;
    handlers reading several streams at once give them one shared event."""
    __slots__ = ("merge", "ready", "pending", "ended", "error")

    def __init__(self, kind: RequestOutputKind, ready: asyncio.Event | None = None):
        self.merge = kind == RequestOutputKind.DELTA
        self.ready = ready or asyncio.Event()
        self.pending: RequestOutput | None = None
        self.ended = False                    # the last output was put (it may still be pending)
        self.error: BaseException | None = None

    def put(self, out: RequestOutput) -> None:
        if self.pending is not None and self.merge:
            merge_delta(self.pending, out)
        else:
            self.pending = out                # cumulative or final: the newest says it all
        self.ended = out.finished
        self.ready.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.ready.set()

    @property
    def done(self) -> bool:
        """The last output was put and read: nothing more will come."""
        return self.pending is None and self.ended

    def take(self) -> RequestOutput | None:
        """What arrived since the last take (None: nothing new); the engine's error once all is read."""
        out, self.pending = self.pending, None
        if out is None and self.error is not None and not self.ended:
            raise self.error
        return out

    async def next(self) -> RequestOutput | None:
        """The next output, waiting for it; None once the request has finished and all is read."""
        while self.pending is None and self.error is None:
            if self.ended:
                return None
            self.ready.clear()
            await self.ready.wait()
        return self.take()


class EngineClient:
    def __init__(self, commands: str, outputs: str, max_waiting_requests: int = 1024, on_finished=None):
        self.max_waiting = max_waiting_requests
        self.on_finished = on_finished           # callback(RequestOutput) for every finished request (metrics)
        self.dead: str | None = None
        self.stats = {"running": 0, "waiting": 0, "preemptions": 0, "kv_usage": 0.0, "draft_tokens": 0,
                      "accepted_tokens": 0}
        self._ctx = zmq.asyncio.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._outputs = self._ctx.socket(zmq.PULL)
        for sock, endpoint in ((self._commands, commands), (self._outputs, outputs)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
        self._open: dict[str, RequestStream] = {}
        self._prompts: dict[str, tuple] = {}      # running requests' (prompt, prompt ids), from their first output
        self._accepting: dict[str, asyncio.Future] = {}
        self._ids = itertools.count()
        self._receiver: asyncio.Task | None = None

    async def wait_ready(self) -> dict:
        """The engine's first message, once it is up: what it serves (model path, max_model_len)."""
        msg = wire.unpack(await self._outputs.recv())
        if msg["op"] != "ready":
            raise RuntimeError(f"the engine's first message was {msg['op']!r}, not 'ready'")
        return msg

    def start(self) -> None:
        """Start receiving (on the running event loop)."""
        self._receiver = asyncio.ensure_future(self._receive())

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self._ctx.destroy(linger=0)

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def num_waiting(self) -> int:
        return self.stats["waiting"] + len(self._accepting)

    async def submit(self, request_id: str, prompt, params: SamplingParams,
                     ready: asyncio.Event | None = None) -> RequestStream:
        """Hand a request to the engine; returns its stream (which sets `ready` when it has news) once the
        engine accepted it. Validation's ValueError / TypeError propagate; EngineDead and Overloaded say why
        nothing was queued."""
        if self.dead:
            raise EngineDead(self.dead)
        if self.num_waiting() >= self.max_waiting:
            raise Overloaded(f"{self.num_waiting()} requests are waiting (--max-waiting-requests "
                             f"{self.max_waiting}); try again later")
        stream = RequestStream(params.output_kind, ready)
        accepted = asyncio.get_running_loop().create_future()
        self._open[request_id], self._accepting[request_id] = stream, accepted
        try:
            await self._commands.send(wire.pack({"op": "add", "id": request_id, "prompt": prompt,
                                                 "params": wire.params_to_wire(params)}))
            await accepted
        except BaseException:
            self._open.pop(request_id, None)
            raise
        finally:
            self._accepting.pop(request_id, None)
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (its client went away); it leaves the engine before the next step."""
        if self._open.pop(request_id, None) is not None and not self.dead:
            self._commands.send(wire.pack({"op": "abort", "id": request_id}))

    async def _receive(self) -> None:
        while True:
            msg = wire.unpack(await self._outputs.recv())
            op = msg["op"]
            if op == "outputs":
                self.stats = msg["stats"]
                for row in msg["outputs"]:
                    self._deliver(wire.output_from_wire(row))
            elif op == "accepted":
                for request_id, error, kind in msg["items"]:
                    future = self._accepting.get(request_id)
                    if future is not None and not future.done():
                        future.set_result(None) if error is None else \
                            future.set_exception(_ERRORS.get(kind, EngineDead)(error))
            elif op == "dead":
                self._fail_all(msg["why"])

    def _deliver(self, out: RequestOutput) -> None:
        if out.prompt_token_ids is None:          # only a request's first output carries its prompt (wire.py)
            out.prompt, out.prompt_token_ids = self._prompts[out.request_id]
        elif not out.finished:
            self._prompts[out.request_id] = (out.prompt, out.prompt_token_ids)
        stream = self._open.get(out.request_id)
        if out.finished:
            self._prompts.pop(out.request_id, None)
            self._open.pop(out.request_id, None)
            if self.on_finished is not None:
                self.on_finished(out)
        if stream is not None:
            stream.put(out)

    def _fail_all(self, why: str) -> None:
        self.dead = why
        log.error("engine loop: %s", why)
        exc = EngineDead(why)
        for stream in self._open.values():
            stream.fail(exc)
        self._open.clear()
        self._prompts.clear()
        for future in self._accepting.values():
            if not future.done():
                future.set_exception(exc)
