"""The one thread that owns the LLM while serving.

HTTP handlers never touch the engine: they put commands (add, abort) in an inbox and await a RequestStream per
request. Between two steps the loop drains the inbox (new requests join the next step: continuous batching across
clients), runs a step, and hands each request's output to its stream on the event loop. A stream holds one
output: a delta output that its reader has not taken yet is merged with the next, so a client (or an event
loop) slower than the engine gets fewer, larger chunks instead of a backlog, and serving costs less per token as
the load grows. When the engine fails, every open request gets the error and later submissions are refused.
"""
import asyncio
import itertools
import logging
import queue
import threading
from dataclasses import dataclass

from nanovllm_tp.outputs import RequestOutput, merge_delta
from nanovllm_tp.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger("nanovllm_tp")


class EngineDead(RuntimeError):
    """The engine stopped (closed or failed): no request can be served any more."""


class Overloaded(RuntimeError):
    """Too many requests wait already."""


class RequestStream:
    """One request's outputs as its handler reads them (on the event loop). `ready` is set whenever there is
    something to read; handlers reading several streams at once give them one shared event."""
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


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: object
    params: SamplingParams
    outputs: RequestStream
    accepted: asyncio.Future        # set once the engine validated and queued the request (or refused it)
    loop: asyncio.AbstractEventLoop


class EngineLoop:
    def __init__(self, llm, max_waiting_requests: int = 1024, on_finished=None):
        self.llm = llm
        self.max_waiting = max_waiting_requests
        self.on_finished = on_finished           # callback(RequestOutput) for every finished request (metrics)
        self.dead: str | None = None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._open: dict[str, _Add] = {}
        self._pending = 0                          # adds in the inbox, not yet in the scheduler
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="nanovllm_tp-engine-loop", daemon=True)
        self._thread.start()

    # ---- called from the event loop ----

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def num_waiting(self) -> int:
        return len(self.llm.engine.scheduler.waiting) + self._pending

    async def submit(self, request_id: str, prompt, params: SamplingParams,
                     ready: asyncio.Event | None = None) -> RequestStream:
        """Hand a request to the engine; returns its output stream (set `ready` when it has news) once the
        engine accepted it. A ValueError /
        TypeError from validation propagates; EngineDead and Overloaded say why nothing was queued."""
        if self.dead:
            raise EngineDead(self.dead)
        if self.num_waiting() >= self.max_waiting:
            raise Overloaded(f"{self.num_waiting()} requests are waiting (--max-waiting-requests "
                             f"{self.max_waiting}); try again later")
        loop = asyncio.get_running_loop()
        item = _Add(request_id, prompt, params, RequestStream(params.output_kind, ready), loop.create_future(), loop)
        with self._pending_lock:
            self._pending += 1
        self._inbox.put(item)
        self._wake.set()
        await item.accepted
        return item.outputs

    def abort(self, request_id: str) -> None:
        """Abort a request (its client went away); it leaves the engine before the next step."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain()
                if not self.llm.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver(self.llm.step())
        except BaseException as exc:        # a dead rank, a bug: every open request learns it
            self.dead = f"the engine stopped: {exc}"
            log.error("engine loop: %s", self.dead)
            self._fail_all(EngineDead(self.dead))
            return
        self.dead = "the server is shutting down"
        self._fail_all(EngineDead(self.dead))

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                _, request_id = item
                if request_id in self._open:
                    self.llm.abort_request(request_id)
                continue
            with self._pending_lock:
                self._pending -= 1
            try:
                self.llm.add_request(item.prompt, item.params, request_id=item.request_id)
            except Exception as exc:         # validation: the handler turns it into a 400
                item.loop.call_soon_threadsafe(_settle, item.accepted, exc)
                continue
            self._open[item.request_id] = item
            item.loop.call_soon_threadsafe(_settle, item.accepted, None)

    def _deliver(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their queues: one wake-up of each event loop per step, not one per request."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outs:
            item = self._open.get(out.request_id)
            if item is None:
                continue
            batches.setdefault(item.loop, []).append((item.outputs, out))
            if out.finished:
                del self._open[out.request_id]
                if self.on_finished is not None:
                    self.on_finished(out)
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, exc: BaseException) -> None:
        for item in list(self._open.values()):
            item.loop.call_soon_threadsafe(item.outputs.fail, exc)
        self._open.clear()
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not isinstance(item, tuple):
                item.loop.call_soon_threadsafe(_settle, item.accepted, exc)


def _put_all(batch: list) -> None:
    for stream, out in batch:
        stream.put(out)


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)
