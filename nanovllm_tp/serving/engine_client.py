"""The HTTP process's handle on the engine loop (serving/engine_loop.py, in rank 0's process).

Handlers submit requests and read a RequestStream each; one task receives the engine's messages and hands each
step's outputs to their streams. A stream holds one output: a delta output its reader has not taken yet is
merged with the next, so a client slower than the engine gets fewer, larger chunks instead of a backlog, and
serving costs less per token as the load grows.
"""
import asyncio
import contextlib
import itertools
import logging
import time

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
    __slots__ = ("merge", "whole", "ready", "pending", "ended", "error", "read", "progress", "extra_tokens")

    def __init__(self, kind: RequestOutputKind, ready: asyncio.Event | None = None, track: bool = False,
                 whole: bool = False):
        """`track`: remember what its handler took of each completion (a data-parallel replica's delta stream,
        which another replica can resume from there). `whole`: a DELTA stream whose handler wants the final
        output only (a non-streamed request that travels as a stream, so that it can move between replicas, its
        KV with it): its deltas are merged as they come, and it has nothing to read until the last one."""
        self.merge = kind == RequestOutputKind.DELTA
        self.whole = whole and self.merge
        self.ready = ready or asyncio.Event()
        self.pending: RequestOutput | None = None
        self.ended = False                    # the last output was put (it may still be pending)
        self.error: BaseException | None = None
        self.read = False                     # its handler took an output: something may have reached the client
        # completion index -> [token ids taken, characters of text taken, finished]
        self.progress: dict[int, list] | None = {} if track and self.merge else None
        self.extra_tokens = 0                 # tokens of completions that finished on an engine before a resume

    def put(self, out: RequestOutput) -> None:
        if out.finished and self.extra_tokens and getattr(out, "metrics", None) is not None:
            out.metrics.num_generation_tokens += self.extra_tokens     # the usage counts every completion
        if self.pending is not None and self.merge:
            merge_delta(self.pending, out)
        else:
            self.pending = out                # cumulative or final: the newest says it all
        self.ended = out.finished
        if self.whole and self.ended:         # completions in index order, as one final output has them
            self.pending.outputs.sort(key=lambda c: c.index)
        if self.ended or not self.whole:
            self.ready.set()

    def fail(self, exc: BaseException) -> None:
        self.error = exc
        self.ready.set()

    @property
    def has_news(self) -> bool:
        """take() would return an output or raise the engine's error."""
        if self.whole and not self.ended:
            return self.error is not None
        return self.pending is not None or (self.error is not None and not self.ended)

    @property
    def done(self) -> bool:
        """The last output was put and read: nothing more will come."""
        return self.pending is None and self.ended

    def take(self) -> RequestOutput | None:
        """What arrived since the last take (None: nothing new); the engine's error once all is read. A whole
        stream gives its merged output once it ended, and its error at once (half an answer is none)."""
        if self.whole and not self.ended:
            if self.error is not None:
                raise self.error
            return None
        out, self.pending = self.pending, None
        if out is None and self.error is not None and not self.ended:
            raise self.error
        self.read = self.read or out is not None
        if out is not None and self.progress is not None:
            add_progress(self.progress, out)
        return out

    def restart(self) -> None:
        """Forget what arrived unread: the request runs again elsewhere, from its start (nothing was read) or
        from what was read (resumed)."""
        self.pending, self.ended = None, False

    async def next(self) -> RequestOutput | None:
        """The next output, waiting for it; None once the request has finished and all is read."""
        while self.pending is None and self.error is None:
            if self.ended:
                return None
            self.ready.clear()
            await self.ready.wait()
        return self.take()


def add_progress(progress: dict[int, list], out: RequestOutput) -> None:
    """Count a delta output into a stream's progress: per completion index, [token ids, characters, finished]."""
    for c in out.outputs:
        taken = progress.setdefault(c.index, [[], 0, False])
        taken[0] += c.token_ids
        taken[1] += len(c.text)
        taken[2] = taken[2] or c.finish_reason is not None


class EngineClient:
    def __init__(self, commands: str, outputs: str, max_waiting_requests: int = 1024, on_finished=None,
                 name: str = "engine", on_gone=None, rescue=None, curve: tuple | None = None):
        """`on_gone`: a data-parallel replica's engine process may die and come back: its socket's disconnection
        fails its open requests at once and calls on_gone(); its "ready" on the same sockets revives it. Without
        (one engine), the HTTP process leaves when its engine's process is gone (frontend.py). `rescue(streams,
        why)`: when the engine stops, it is handed the open requests ({id: stream}) before the rest fail, and
        returns the ids it took over (run elsewhere). `curve`: (this side's public key, its secret key, the engine
        loop's public key) for an engine loop on another node (tcp://)."""
        self.max_waiting = max_waiting_requests
        self.on_finished = on_finished           # callback(RequestOutput) for every finished request (metrics)
        self.name, self.on_gone, self.rescue = name, on_gone, rescue
        self.dead: str | None = None
        self.shut_down = False          # it stopped because the server is stopping (no coming back)
        self._starting = False
        self.stats = dict(wire.NO_STATS)
        self._ctx = zmq.asyncio.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._outputs = self._ctx.socket(zmq.PULL)
        for sock, endpoint in ((self._commands, commands), (self._outputs, outputs)):
            sock.setsockopt(zmq.LINGER, 0)
            if curve is not None:
                sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = curve
            sock.connect(endpoint)
        self._open: dict[str, RequestStream] = {}
        self._prompts: dict[str, tuple] = {}      # running requests' (prompt, prompt ids), from their first output
        self._accepting: dict[str, asyncio.Future] = {}
        self._unaccepted: set[str] = set()        # ids of the batches in _accepting (submit's caller retries them)
        self._ids = itertools.count()
        self._receiver: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._last_heard = time.monotonic()
        self._accepted_since_stats = 0
        self.migrated: dict[str, bytes] = {}      # a restarting replica's open requests with their KV ("migrate")
        self.on_handoff = None    # callback(request id, stream, payload): a prefill replica handed a request over
        self.on_stats = None      # callback(): the engine's figures just came (the router's rebalancing looks)

    async def wait_ready(self) -> dict:
        """The engine's first message, once it is up: what it serves (model path, max_model_len)."""
        msg = wire.unpack(await self._outputs.recv())
        self._last_heard = time.monotonic()
        if msg["op"] != "ready":
            raise RuntimeError(f"the engine's first message was {msg['op']!r}, not 'ready'")
        return msg

    def mark_starting(self) -> None:
        """A data-parallel replica still loading while the others serve: nothing goes to it until its "ready"."""
        self.dead, self._starting = f"{self.name} is starting", True

    def start(self) -> None:
        """Start receiving (on the running event loop)."""
        self._receiver = asyncio.ensure_future(self._receive())
        if self.on_gone is not None:
            self._watcher = asyncio.ensure_future(self._watch_peer(self._outputs.get_monitor_socket(
                zmq.EVENT_DISCONNECTED)))

    def close(self) -> None:
        for task in (self._receiver, self._watcher):
            if task is not None:
                task.cancel()
        self._ctx.destroy(linger=0)

    async def _watch_peer(self, monitor) -> None:
        """The engine process's end of the outputs socket closed: it died (a clean stop says so first)."""
        while True:
            await monitor.recv_multipart()
            if self.dead is None:
                self.fail_all(f"{self.name} stopped: its engine process is gone")
            self.on_gone()

    def labelled_stats(self) -> list[tuple[dict, dict]]:
        """[(extra metric labels, the engine's latest figures)]: one engine, no extra label (/metrics)."""
        return [({}, self.stats)]

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def num_waiting(self) -> int:
        return self.stats["waiting"] + self.num_unreported()

    def num_unreported(self) -> int:
        """Requests handed to the engine that its figures do not count yet: batches waiting for "accepted", and
        requests accepted since its last report."""
        return len(self._accepting) + self._accepted_since_stats

    async def submit(self, request_ids: list[str], prompts: list[list[int]], params: SamplingParams,
                     priority: int = 0, lora: list | None = None,
                     streams: list[RequestStream] | None = None, resume: list | None = None,
                     kv: list | None = None, handoff: str | None = None) -> list[RequestStream]:
        """Hand the engine one request per prompt (token ids), all with the same parameters, all or none; returns
        their streams (sharing one `ready` event, set when any has news) once the engine accepted them.
        Validation's ValueError / TypeError propagate (then none was queued); EngineDead and Overloaded say why
        nothing was queued. A batch counts once against max_waiting_requests. `lora`: the adapter's [name, id,
        path], or None. `streams`: the requests' streams already (they ran on another engine, which stopped);
        `resume`: per prompt, the [index, token ids, characters sent] of each completion to go on with (wire.py),
        for a request whose output was read in part; `kv`: per prompt, the payload its stopped replica exported
        (engine/kv_transfer.py) or None, which the engine takes the resumed completions' KV from; `handoff`: a
        prefill replica's request, which leaves after its first tokens (on_handoff), its KV by reference to the
        replica's shared pool ("pool": every replica on this host) or as bytes ("bytes")."""
        if self.dead:
            raise EngineDead(self.dead)
        if self.num_waiting() >= self.max_waiting:
            raise Overloaded(f"{self.num_waiting()} requests are waiting (--max-waiting-requests "
                             f"{self.max_waiting}); try again later")
        if streams is None:
            ready = asyncio.Event()
            streams = [RequestStream(params.output_kind, ready, track=self.rescue is not None)
                       for _ in request_ids]
        key = request_ids[0]
        accepted = asyncio.get_running_loop().create_future()
        self._open.update(zip(request_ids, streams))
        self._accepting[key] = accepted
        self._unaccepted.update(request_ids)
        try:
            msg = {"op": "add", "ids": request_ids, "prompts": prompts, "params": wire.params_to_wire(params),
                   "priority": priority, "lora": lora}
            if resume is not None:
                msg["resume"] = resume
            if kv is not None:
                msg["kv"] = kv
            if handoff:
                msg["handoff"] = handoff
            await self._commands.send(wire.pack(msg))
            await accepted
        except BaseException:
            for rid in request_ids:
                self._open.pop(rid, None)
            raise
        finally:
            self._accepting.pop(key, None)
            self._unaccepted.difference_update(request_ids)
        return streams

    async def lora(self, op: str, lora: list) -> None:
        """Have the engine load ("lora_load": check) or unload ("lora_unload") an adapter [name, id, path];
        its ValueError / TypeError propagate."""
        if self.dead:
            raise EngineDead(self.dead)
        key = self.new_request_id(op)
        done = self._accepting[key] = asyncio.get_running_loop().create_future()
        try:
            await self._commands.send(wire.pack({"op": op, "ids": [key], "lora": lora}))
            await done
        finally:
            self._accepting.pop(key, None)

    async def move(self, request_ids: list[str], kv: str) -> None:
        """Ask the engine to hand these running streams over after their next outputs, with their KV (`kv`, as
        submit's `handoff`: "pool", by reference to its shared pool, or "bytes"), as a prefill replica does
        ("handoff"): the router's rebalancing (replica_set.py)."""
        if not self.dead:
            with contextlib.suppress(zmq.ZMQError):
                await self._commands.send(wire.pack({"op": "move", "ids": request_ids, "kv": kv}), zmq.NOBLOCK)

    def movable(self) -> list[str]:
        """Its open streams that have had output and are going on (what rebalancing may move), oldest first."""
        return [rid for rid, s in self._open.items() if s.merge and (s.read or s.pending is not None)
                and not s.ended and s.error is None and rid not in self._unaccepted]

    async def release(self) -> None:
        """Tell this restarting replica that the requests it migrated by reference have been copied out of its KV
        pool (or will not be): it may exit (engine_loop._await_release)."""
        with contextlib.suppress(zmq.ZMQError):
            await self._commands.send(wire.pack({"op": "released"}), zmq.NOBLOCK)

    def abort(self, request_ids) -> None:
        """Abort requests (their client went away); they leave the engine before its next step."""
        ids = [rid for rid in request_ids if self._open.pop(rid, None) is not None]
        if ids and not self.dead:
            self._commands.send(wire.pack({"op": "abort", "ids": ids}))

    def silent_for(self) -> float:
        """Seconds since the engine loop last said anything (it speaks after every step, and every
        HEARTBEAT_S when idle)."""
        return time.monotonic() - self._last_heard

    async def _receive(self) -> None:
        while True:
            msg = wire.unpack(await self._outputs.recv())
            self._last_heard = time.monotonic()
            op = msg["op"]
            if op == "outputs":
                self.stats, self._accepted_since_stats = msg["stats"], 0
                for row in msg["outputs"]:
                    self._deliver(wire.output_from_wire(row))
                if self.on_stats is not None:
                    self.on_stats()
            elif op == "accepted":
                for request_id, error, kind in msg["items"]:
                    future = self._accepting.get(request_id)
                    if future is not None and not future.done():
                        future.set_result(None) if error is None else \
                            future.set_exception(_ERRORS.get(kind, EngineDead)(error))
                    self._accepted_since_stats += error is None and future is not None
            elif op == "migrate":     # a restarting replica's open requests, with their KV: before its "dead"
                self.migrated.update(msg["payloads"])
            elif op == "handoff":     # requests that left this (prefill) replica with their KV, after their outputs
                self.stats = msg["stats"]
                for rid, payload in msg["payloads"].items():
                    self._prompts.pop(rid, None)
                    stream = self._open.pop(rid, None)
                    if stream is not None and self.on_handoff is not None:
                        self.on_handoff(rid, stream, payload)
            elif op == "dead":        # a replica's reason names it: /health lists the replicas that are down
                self.fail_all(msg["why"] if self.on_gone is None else f"{self.name}: {msg['why']}",
                              msg.get("shutdown", False), msg.get("restart", False))
            elif op == "ready" and self.dead is not None:      # a replica up late, or restarted on the same sockets
                (log.info if self._starting else log.warning)("%s is %s", self.name,
                                                              "ready" if self._starting else "back")
                self.dead, self._starting, self.shut_down = None, False, False

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

    def fail_all(self, why: str, shutdown: bool = False, restart: bool = False) -> None:
        """No request can be served any more: every open one ends with `why` (EngineDead), or moves to another
        replica (`rescue`) unless the whole server is shutting down. `restart`: a planned stop (a rolling restart),
        logged as such."""
        if self.dead:
            return
        self.dead = why
        self.shut_down = shutdown
        (log.info if shutdown or restart else log.error)("%s loop: %s", self.name, why)
        exc = EngineDead(why)
        taken = set()
        if self.rescue is not None and not shutdown:
            taken = self.rescue({rid: s for rid, s in self._open.items()
                                 if not s.done and rid not in self._unaccepted}, why)
        self.migrated.clear()
        for rid, stream in self._open.items():
            if rid not in taken and rid not in self._unaccepted:    # those end through their submit's error:
                stream.fail(exc)                                    # its caller may place them elsewhere
        self._open.clear()
        self._prompts.clear()
        for future in self._accepting.values():
            if not future.done():
                future.set_exception(exc)
