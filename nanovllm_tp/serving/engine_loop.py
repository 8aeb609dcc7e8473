"""The engine side of the server: rank 0's main thread owns the LLM and serves the HTTP process.

Once the engine is up, the loop binds its sockets and tells the HTTP process (started earlier, so that its imports
overlap the engine's loading) what it serves.

The HTTP process (serving/frontend.py) parses requests, tokenizes prompts (chats through their template) and
writes server-sent events; this loop only runs the engine, on token ids. They are separate processes so that
neither waits for the other's interpreter lock: on a small model a step takes a few milliseconds, about what the
HTTP side spends per step on 64 streams.

Between two steps the loop takes every command that arrived (adds join the next step: continuous batching
across clients; aborts leave before it), runs a step and sends its outputs in one message with the scheduler's
figures for /metrics; idle, it still sends those figures every HEARTBEAT_S, so that a silent loop means a stuck
one (/health). A PUSH socket whose only peer is gone blocks a send for ever, so every send waits at most
SEND_WAIT_MS at a time and asks between two waits whether the HTTP process still lives, and whether the loop was
told to stop: a killed HTTP process ends the loop within a fraction of a second, whether it died between two
steps, during a step or just before a heartbeat, and so does a signal that came while a send waited. A batch with a structured output is added once its grammar has compiled (in the backend's threads,
LLM.prepare), so no step waits for a compile; a compile that fails or runs past its time limit is that request's
400. When the engine fails, the HTTP process is told once and the loop only waits to be stopped: the server
answers 503 from then on.
"""
import logging
import time

import zmq

from nanovllm_tp.engine.resume import ResumedChoice
from nanovllm_tp.lora import LoRARequest
from nanovllm_tp.serving import wire

log = logging.getLogger("nanovllm_tp")
IDLE_POLL_MS = 200
HEARTBEAT_S = 1.0
COMPILE_POLL_MS = 2        # how often an idle loop looks at compiles in flight
SEND_WAIT_MS = 100         # a send that cannot go out (HTTP process slow, or gone) re-checks its peer this often
RESTART_LINGER_MS = 30_000  # how long a restarting replica waits for its migrated requests to reach the HTTP process
RELEASE_WAIT_S = 30.0       # and for the replicas they moved to to copy their KV out of its pool


class HttpProcessGone(Exception):
    """The HTTP process died: nobody is left to send outputs to."""


class _StopWhileSending(Exception):
    """Told to stop while a send waited for the HTTP process (a data-parallel replica whose HTTP process was
    stopped first: its supervisor, which `http_alive` watches, is still there)."""


def scheduler_stats(llm) -> dict:
    """The figures /metrics shows, from LLM.counters() (every step: LLM.stats() would cost a millisecond)."""
    s = llm.counters()
    return {"running": s["num_running"], "waiting": s["num_waiting"], "max_seqs": llm.config.max_num_seqs,
            "kv_usage": s["kv_cache_usage"], "kv_blocks": s["num_kv_blocks"], "preemptions": s["num_preemptions"],
            "draft_tokens": s["num_draft_tokens"], "accepted_tokens": s["num_accepted_tokens"],
            "accepted_per_pos": s["num_accepted_tokens_per_pos"],
            "prefix_queries": s["prefix_cache_query_tokens"], "prefix_hits": s["prefix_cache_hit_tokens"],
            **{f"kv_{key}": s["kv_transfer"][key] for key in wire.KV_MOVED}}


class EngineLoop:
    def __init__(self, llm, commands: str, outputs: str, http_alive, loras=(), keys=None, replica: int = 0,
                 exit_when_dead: bool = False):
        """`commands` and `outputs`: the endpoints to bind: ipc:// in a directory only this user can enter, or, for
        a data-parallel replica on another node than the HTTP process, tcp://ADDRESS:* (a free port each; see
        `endpoints`) secured with `keys` (ChannelKeys: CURVE, admitting only the HTTP process; replica_link.py).
        `http_alive()`: whether the HTTP process still runs; `loras`: the (name, path) adapters served from the
        start (ids 1, 2, ...), checked here (ValueError). `exit_when_dead`: a replica's loop ends once its engine
        failed (its process exits, to be started again) instead of waiting to be stopped."""
        self.llm = llm
        self._http_alive = http_alive
        self._keep_going = lambda: True
        self.exit_when_dead = exit_when_dead
        self.failed: str | None = None           # why the engine stopped, once it did
        self.rank_killed = False                 # ... because one of its ranks was killed from outside
        adapters = [llm.loras.check(LoRARequest(name, i + 1, path)) for i, (name, path) in enumerate(loras)]
        self._ctx = zmq.Context()
        self._gate = None
        if keys is not None:
            from nanovllm_tp.serving.replica_link import ReplicaGate
            self._gate = ReplicaGate(self._ctx, keys, replica)
        self._commands = self._ctx.socket(zmq.PULL)
        self._outputs = self._ctx.socket(zmq.PUSH)
        self.endpoints = []
        for sock, endpoint in ((self._commands, commands), (self._outputs, outputs)):
            sock.setsockopt(zmq.LINGER, 0)
            if self._gate is not None:
                self._gate.secure(sock)
            sock.bind(endpoint)
            self.endpoints.append(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        self._linger_ms = 0                     # how long close() waits for queued messages
        self._last_stats = dict(wire.NO_STATS)
        self._prompt_sent: set[str] = set()    # running requests whose prompt went out with an earlier output
        self._last_sent = time.monotonic()
        self._compiling: dict[str, tuple] = {}  # first id -> (add message, params, Pending): waiting for a grammar
        # a prefill replica's requests that leave after their first token -> whether their KV stays in this
        # replica's shared pool for the decode replica to copy (every replica on this host), or travels as bytes
        self._handoff: dict[str, bool] = {}
        self._handoff_refusals: set[str] = set()     # why a request could not leave, each said once
        self._ready = {"op": "ready", "model": llm.config.model, "max_model_len": llm.config.max_model_len,
                       "loras": [a.to_wire() for a in adapters],
                       "tokenizer": llm.config.tokenizer, "sampling_defaults": llm.sampling_defaults}

    def run(self, keep_going) -> None:
        """Serve until keep_going() is false (checked between steps and at least every IDLE_POLL_MS) or the HTTP
        process is gone. Idle, the loop still speaks every HEARTBEAT_S: the HTTP process reads its silence as a
        stuck engine."""
        self._keep_going = keep_going
        try:
            self._send(self._ready)
            self._serve(keep_going)
        except HttpProcessGone:
            log.error("engine loop: the HTTP process is gone; stopping")
        except _StopWhileSending:
            pass

    def _serve(self, keep_going) -> None:
        dead = False
        while keep_going() and self._http_alive():
            busy = not dead and self.llm.has_unfinished_requests()
            changed = self._admit_compiled(dead)
            if self._commands.poll(0 if busy else COMPILE_POLL_MS if self._compiling else IDLE_POLL_MS):
                changed = self._take_commands(dead) or changed
                if not dead and self.llm.engine.dead is not None:   # a rank lost while imported KV was written
                    if self._engine_failed(RuntimeError(self.llm.engine.dead)):
                        return
                    dead = True
            if changed and not dead and not self.llm.has_unfinished_requests():
                self._send_stats()
            if dead or not self.llm.has_unfinished_requests():
                if not dead:                       # idle: a rank that died meanwhile is seen now, not at the next
                    try:                           # request
                        self.llm.check_ranks()
                    except Exception as exc:
                        if self._engine_failed(exc):
                            return
                        dead = True
                if time.monotonic() - self._last_sent > HEARTBEAT_S:
                    self._send_stats(dead)
                continue
            try:
                outs = self.llm.step()
            except Exception as exc:       # a dead rank, a bug: the HTTP side fails every open request
                if self._engine_failed(exc):
                    return
                dead = True
                continue
            self._send({"op": "outputs", "outputs": [self._to_wire(o) for o in outs], "stats": self._stats()})
            if self._handoff:
                try:
                    self._hand_off(outs)
                except Exception as exc:   # a rank lost while the KV was gathered: the engine stopped, as in a step
                    if self._engine_failed(exc):
                        return
                    dead = True

    def _engine_failed(self, exc: Exception) -> bool:
        """The engine stopped (a dead rank, a bug): the HTTP side is told, and fails every open request. Returns
        whether the loop ends here (a replica's process exits, to be started again)."""
        why = self.failed = f"the engine stopped: {exc}"
        self.rank_killed = self.llm.engine.rank_killed
        log.error("engine loop: %s", why)
        self._send({"op": "dead", "why": why})
        return self.exit_when_dead

    def stop(self, why: str, restart: bool = False, migrate: bool = True, interrupted=lambda: False) -> None:
        """The server is going away: every open request ends with this error (the HTTP process answers 503);
        `restart`: only this replica is (a rolling restart), and its open requests move to the others. Sends
        without waiting: an HTTP process that is gone already (a signal to the whole group) gets nothing. A restarting
        replica first sends the HTTP process its open requests with their KV ("migrate": engine/kv_transfer.py's
        payloads), so that the replicas they move to go on decoding them without computing them again, and when
        that KV stayed in its pool it waits for their copies (_await_release, at most RELEASE_WAIT_S); not with
        `migrate` false (--no-migrate-kv-on-restart): they compute them again there. `interrupted()`: a stop
        signal came meanwhile (the wait then ends at once)."""
        by_reference = restart and migrate and self._migrate_out()
        self._send_now({"op": "dead", "why": why, "restart" if restart else "shutdown": True})
        if restart:     # what was queued must reach the HTTP process before the sockets close (close() waits)
            self._linger_ms = RESTART_LINGER_MS
        if by_reference:
            self._await_release(interrupted)

    def _send_now(self, msg: dict) -> None:
        """Send without waiting: while stopping, an HTTP process that is gone or not reading gets nothing."""
        try:
            self._outputs.send(wire.pack(msg), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _migrate_out(self) -> bool:
        """Send the open requests with their KV ("migrate"); True when the KV stayed in this replica's shared
        pool for the other replicas to copy (every replica on this host: the HTTP process's sockets are local),
        so that this process must stay until they have (_await_release)."""
        from nanovllm_tp.engine.kv_transfer import export_all, shares_pool
        by_reference = self._gate is None and shares_pool(self.llm)
        try:
            payloads = export_all(self.llm, by_reference)
        except Exception as exc:          # a failed engine: its requests are computed again where they go
            log.warning("engine loop: the open requests move without their KV (%s)", exc)
            return False
        if payloads:
            self._send_now({"op": "migrate", "payloads": payloads})
        return by_reference and bool(payloads)

    def _await_release(self, interrupted) -> None:
        """A restarting replica whose migrated requests' KV stays in its pool: wait until the HTTP process says
        the replicas they moved to have copied it ("released"), at most RELEASE_WAIT_S, or until the HTTP process
        is gone or a stop signal came (`interrupted()`). A request whose copy finds this pool gone computes its KV
        again where it went."""
        deadline = time.monotonic() + RELEASE_WAIT_S
        while time.monotonic() < deadline and self._http_alive() and not interrupted():
            if not self._commands.poll(SEND_WAIT_MS):
                continue
            msg = wire.unpack(self._commands.recv(copy=False).buffer)
            if msg.get("op") == "released":
                return
        if time.monotonic() >= deadline:
            log.warning("engine loop: the migrated requests were not all taken within %.0f s; those not yet "
                        "copied compute their KV again", RELEASE_WAIT_S)

    def _hand_off(self, outs) -> None:
        """A prefill replica's streams that have their first tokens leave with their KV ("handoff": the HTTP process
        resumes each on a decode replica), after the outputs that carried those tokens. One that cannot move (an
        engine that cannot move KV) decodes here."""
        from nanovllm_tp.engine.kv_transfer import export_request, has_first_tokens
        payloads = {}
        for out in outs:
            rid = out.request_id
            if rid not in self._handoff:
                continue
            if out.finished:
                del self._handoff[rid]
            elif has_first_tokens(self.llm, rid):
                by_reference = self._handoff.pop(rid)
                try:
                    payloads[rid] = export_request(self.llm, rid, by_reference)
                except ValueError as exc:       # each reason once: with TP > 1 it is every request's
                    reason = str(exc).replace(repr(rid), "")
                    if reason not in self._handoff_refusals:
                        self._handoff_refusals.add(reason)
                        log.warning("engine loop: request %s stays on this replica: %s", rid, exc)
        if payloads:
            self._prompt_sent.difference_update(payloads)
            self._send({"op": "handoff", "payloads": payloads, "stats": self._stats()})

    def _send_stats(self, dead: bool = False) -> None:
        self._send({"op": "outputs", "outputs": [], "stats": self._stats(dead)})

    def _stats(self, dead: bool = False) -> dict:
        """The scheduler's figures; a stopped engine runs nothing, and keeps its counters where they were."""
        if dead:
            self._last_stats.update(running=0, waiting=0, kv_usage=0.0)
        else:
            self._last_stats = scheduler_stats(self.llm)
        return self._last_stats

    def _to_wire(self, out) -> list:
        """An output for the HTTP process: the prompt only with a request's first output (wire.py)."""
        first = out.request_id not in self._prompt_sent
        if out.finished:
            self._prompt_sent.discard(out.request_id)
        elif first:
            self._prompt_sent.add(out.request_id)
        return wire.output_to_wire(out, with_prompt=first)

    def close(self) -> None:
        """Close the sockets: at once (what is queued is dropped), or after a rolling restart's stop, once the
        migrated requests and the last word went out (a few hundred MB of KV take a moment), at most
        RESTART_LINGER_MS."""
        if self._gate is not None:
            self._gate.close()
        self._ctx.destroy(linger=self._linger_ms)

    def _send(self, msg: dict) -> None:
        data = wire.pack(msg)
        while True:
            try:
                self._outputs.send(data, zmq.NOBLOCK, copy=False)
                break
            except zmq.Again:          # no peer (not connected yet, or dead), or its queue full
                if not self._http_alive():
                    raise HttpProcessGone from None
                if not self._keep_going():
                    raise _StopWhileSending from None
                self._outputs.poll(SEND_WAIT_MS, zmq.POLLOUT)
        self._last_sent = time.monotonic()

    def _take_commands(self, dead: bool) -> bool:
        accepted, changed = [], False
        while True:
            try:
                raw = self._commands.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            msg = wire.unpack(raw.buffer)
            if msg["op"] == "abort" and not dead:
                for key in msg["ids"]:            # a batch still waiting for its grammar is dropped whole
                    waiting = self._compiling.pop(key, None)
                    if waiting is not None:
                        waiting[2].give_up()      # and its compile too, if nobody else waits for it
                self.llm.abort_request(msg["ids"])
                for rid in msg["ids"]:
                    self._handoff.pop(rid, None)
                changed = True
            elif msg["op"] == "add":
                item = self._add(msg, dead)
                if item is not None:
                    accepted.append(item)
                changed = True
            elif msg["op"] == "move" and not dead:     # rebalancing: running streams leave after their outputs
                from nanovllm_tp.engine.kv_transfer import has_first_tokens
                self._handoff.update({rid: msg["kv"] == "pool" for rid in msg["ids"]
                                      if has_first_tokens(self.llm, rid)})
            elif msg["op"] in ("lora_load", "lora_unload"):
                accepted.append(self._lora(msg, dead))
        if accepted:
            self._send({"op": "accepted", "items": accepted})
        return changed

    def _add(self, msg: dict, dead: bool, params=None, pending=None) -> list | None:
        """[first id, error message or None, error type] for one batch, queued all or none: validation errors
        go back to the client as a 400. None: the batch waits for its grammar (_admit_compiled adds it, with
        its `pending` compile: done, failed, or past this request's time limit)."""
        key = msg["ids"][0]
        if dead:
            if pending is not None:
                pending.give_up()
            return [key, "the engine stopped", "EngineDead"]
        try:
            if pending is not None:
                pending.result(wait=False)    # the compile's verdict, or this request's time limit: a 400
            if params is None:
                params = wire.params_from_wire(msg["params"])
                pending = self.llm.prepare(params)
                if pending is not None and not pending.ready():
                    self._compiling[key] = (msg, params, pending)
                    return None
            lora, resume = msg.get("lora"), msg.get("resume")
            lora = LoRARequest(*lora) if lora else None
            if resume is not None:
                resume = [[ResumedChoice.from_wire(row) for row in choices] for choices in resume]
            start, kv = time.perf_counter(), self._kv_of(msg, resume, lora)
            self.llm.add_requests(msg["prompts"], params, request_ids=msg["ids"], max_tokens_must_fit=True,
                                  priority=msg["priority"], lora_request=lora, resume=resume, kv=kv)
            if msg.get("handoff"):
                self._handoff.update(dict.fromkeys(msg["ids"], msg["handoff"] == "pool"))
            if kv is not None:
                from nanovllm_tp.engine.kv_transfer import note_import
                for entries in kv:
                    if any(e is not None for e in entries):
                        note_import(self.llm, entries, (time.perf_counter() - start) / len(kv))
        except (ValueError, TypeError) as exc:
            return [key, str(exc), type(exc).__name__]
        except RuntimeError as exc:        # a rank lost while imported KV was written: the batch goes elsewhere
            if self.llm.engine.dead is None:
                raise
            return [key, f"the engine stopped: {exc}", "EngineDead"]
        return [key, None, None]

    def _kv_of(self, msg: dict, resume: list | None, lora: LoRARequest | None) -> list | None:
        """The `kv` argument of add_requests for a resumed request (running `lora`) that brings the payloads its
        replica exported (msg["kv"]: per prompt, bytes or None), or None. A payload that does not fit (or was
        computed under another adapter) is dropped with a warning: its request computes its tokens again, as one
        without KV does."""
        payloads = msg.get("kv")
        if payloads is None or resume is None or not isinstance(payloads, list) or len(payloads) != len(resume):
            return None
        from nanovllm_tp.engine.kv_transfer import kv_for_resume
        kv, lora_id = [], 0 if lora is None else lora.lora_int_id
        for rid, prompt, choices, raw in zip(msg["ids"], msg["prompts"], resume, payloads):
            entries = None
            if raw is not None:
                try:
                    entries = kv_for_resume(self.llm, raw, prompt, choices, lora_id)
                except ValueError as exc:
                    log.warning("engine loop: request %s computes its KV again: %s", rid, exc)
            kv.append(entries or [None] * len(choices))
        return kv

    def _lora(self, msg: dict, dead: bool) -> list:
        """An adapter the server loads (checked: its directory, against the model) or unloads, by its id."""
        key = msg["ids"][0]
        if dead:
            return [key, "the engine stopped", "EngineDead"]
        try:
            if msg["op"] == "lora_load":
                self.llm.loras.check(LoRARequest(*msg["lora"]))
            else:
                self.llm.remove_lora(msg["lora"][1])
        except (ValueError, TypeError) as exc:
            return [key, str(exc), type(exc).__name__]
        return [key, None, None]

    def _admit_compiled(self, dead: bool) -> bool:
        """Add the batches whose grammar is ready (or failed, or ran out of time: their error goes back)."""
        done = [key for key, (_, _, pending) in self._compiling.items() if dead or pending.ready()]
        if not done:
            return False
        items = []
        for key in done:
            msg, params, pending = self._compiling.pop(key)
            items.append(self._add(msg, dead, params, pending))
        self._send({"op": "accepted", "items": items})
        return True
