"""The HTTP process's handle on D data-parallel replicas (`serve --data-parallel-size D`): one EngineClient per
replica, and a router (router.py) that sends each request to one of them. It answers the EngineClient calls the
routes make (submit, abort, lora, dead, silent_for, labelled_stats), so that the routes serve one replica or many alike.

A batch of prompts submitted together goes to one replica (all or none there); a request's later aborts follow
it. A non-streamed request travels between the processes as a stream whose pieces its handler gets merged, once
(RequestStream's `whole`), so that everything below that moves a stream moves it too. Replicas share nothing. When
a replica stops (its process died, or its engine failed), its open requests move to another live replica, the
client none the wiser: a stream of which nothing was read yet runs again from its start; a stream read in part is
resumed from what its client has (its prompt, and each unfinished completion's tokens and text so far:
engine/resume.py), so that it goes on with no error and no repeated text; a non-streamed request is resumed from
every token it had (none: from its start). New requests go to the live replicas; while none is up,
requests (new or moved) wait up to REPLICA_WAIT_S for one to come back, and only then end with the replicas'
error (EngineDead, with their reasons). A request that has moved MAX_MOVES times ends with its replica's error
at the next stop: a request that crashes every engine it reaches must not take every replica down in turn. When
the server restarts it, the replica says "ready" again on the same sockets and takes requests again, its prefix
record in the router forgotten. Adapter loads and unloads go to every live replica.

Rebalancing (--rebalance, on by default): when a replica that decodes queues requests (some waiting while it runs
others: its KV pool or its sequence slots are full) and another has room (nothing waiting, under half its KV in use,
a free slot), up to MAX_REBALANCE of the first one's newest running requests (streamed or not) move to the
replicas with room, with their KV (copied from pool to pool on one host), as a prefill replica's hand-off does; the
requests queued behind them start sooner. At most one such move per replica is under way, and the router looks
again REBALANCE_EVERY_S later.
"""
import asyncio
import copy
import logging
import time
from dataclasses import dataclass

from nanovllm_tp.sampling_params import RequestOutputKind, SamplingParams
from nanovllm_tp.serving.engine_client import EngineClient, EngineDead, Overloaded, RequestStream, add_progress
from nanovllm_tp.serving.replica_roles import DECODES, PREFILLS
from nanovllm_tp.serving.router import NoReplica, ReplicaLoad, make_router

log = logging.getLogger("nanovllm_tp")
REPLICA_WAIT_S = 60.0      # how long a request waits for a replica to come back while none is up
MAX_MOVES = 3              # a request moved this often ends with its replica's error: it may be what kills them
WAIT_POLL_S = 0.1
REBALANCE_EVERY_S = 0.25   # how often the router looks for a replica that queues while another has room
MAX_REBALANCE = 4          # streams moved off one replica at a time


@dataclass(slots=True)
class Placed:
    """An open request: where it runs, and what it takes to run it again elsewhere."""
    replica: int
    prompt: list[int]
    params: SamplingParams
    priority: int
    lora: list | None
    moves: int = 0          # times it moved off a replica that stopped under it


class ReplicaSet:
    def __init__(self, endpoints: list[tuple[str, str]], max_waiting_requests: int, policy: str,
                 block_size: int = 16, curve: list | None = None, roles: list[str] | None = None,
                 rebalance: bool = True):
        """`endpoints`: (commands, outputs) of each replica's engine loop, in replica order; `curve`: each
        replica's CURVE keys for EngineClient (None where its sockets are local); `roles`: each replica's role
        (replica_roles.py; default: every one mixed)."""
        self.max_waiting = max_waiting_requests
        curve = curve or [None] * len(endpoints)
        self.replicas = [EngineClient(c, o, max_waiting_requests, name=f"replica {i}",
                                      on_gone=lambda i=i: self.replica_died(i), rescue=self._rescue, curve=curve[i])
                         for i, (c, o) in enumerate(endpoints)]
        self.router = make_router(policy, len(self.replicas), block_size)
        self.roles = roles or ["mixed"] * len(self.replicas)
        # a hand-off's KV stays in the prefill replica's shared pool for the decode replica to copy where every
        # replica runs on this host (local sockets); across nodes it travels as bytes
        self._handoff_kv = "pool" if all(c is None for c in curve) else "bytes"
        for client in self.replicas:
            client.on_handoff = self._handoff
            client.on_stats = self._rebalance
        self.rebalance = rebalance
        self._rebalance_at = 0.0
        self._rebalancing: set[str] = set()      # streams asked to move off their replica, until they do
        self.num_rebalanced = 0                   # streams moved to a replica with room (/metrics)
        self.num_handed_off = 0                   # streams a prefill replica handed to a decode replica (/metrics)
        self.kv_bytes_handed_off = 0              # and the bytes of their payloads
        self._owner: dict[str, Placed] = {}      # open request id -> where it runs
        self._moving: set[str] = set()            # requests on their way to another replica (_resubmit)
        self._abandoned: set[str] = set()         # of those, the ones whose client went away meanwhile
        self.num_resubmitted = 0                  # requests run again off a stopped replica (/metrics)
        self.num_resumed = 0                      # streams resumed off a stopped replica (/metrics)
        self.num_migrated = 0                     # of those, the ones that moved with their KV (/metrics)
        self.kv_bytes_migrated = 0                # and the bytes of those payloads
        self._sent = [0] * len(self.replicas)   # batches handed to each replica and not yet accepted
        self._loras: list[set[int]] = [set() for _ in self.replicas]     # adapters each replica has run

    @property
    def on_finished(self):
        return self.replicas[0].on_finished

    @on_finished.setter
    def on_finished(self, callback) -> None:
        def finished(out, _callback=callback):
            self._owner.pop(out.request_id, None)
            if _callback is not None:
                _callback(out)
        for client in self.replicas:
            client.on_finished = finished

    @property
    def dead(self) -> str | None:
        """Why nothing can be served: every replica is dead (None while one lives)."""
        if any(c.dead is None for c in self.replicas):
            return None
        return "; ".join(c.dead for c in self.replicas)

    def labelled_stats(self) -> list[tuple[dict, dict]]:
        """Each replica's latest figures, labelled dp_rank (/metrics)."""
        return [({"dp_rank": str(i)}, c.stats) for i, c in enumerate(self.replicas)]

    def replica_states(self) -> list[dict]:
        """Per replica: alive, and its latest figures (/health, /metrics)."""
        return [{"alive": c.dead is None, "why": c.dead, **c.stats} for c in self.replicas]

    async def wait_ready(self) -> dict:
        """The first replica's "ready" (what it serves): the server takes requests from then on; the replicas
        still loading count as dead until their own "ready" arrives."""
        waits = {asyncio.ensure_future(c.wait_ready()): c for c in self.replicas}
        done, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
            waits[task].mark_starting()
        return next(iter(done)).result()

    def start(self) -> None:
        for client in self.replicas:
            client.start()

    def close(self) -> None:
        for client in self.replicas:
            client.close()

    def new_request_id(self, prefix: str) -> str:
        return self.replicas[0].new_request_id(prefix)

    def num_waiting(self) -> int:
        return sum(c.num_waiting() for c in self.replicas)

    def silent_for(self) -> float:
        """The longest silence of a live replica: one stuck replica makes /health say so."""
        return max((c.silent_for() for c in self.replicas if c.dead is None), default=0.0)

    def _loads(self, lora_id: int | None) -> list[ReplicaLoad]:
        return [ReplicaLoad(running=c.stats["running"], waiting=c.stats["waiting"], kv_usage=c.stats["kv_usage"],
                            alive=c.dead is None, loras=frozenset(self._loras[i]),
                            pending=c.num_unreported() + self._sent[i], max_seqs=c.stats.get("max_seqs", 0))
                for i, c in enumerate(self.replicas)]

    async def submit(self, request_ids: list[str], prompts: list[list[int]], params: SamplingParams,
                     priority: int = 0, lora: list | None = None) -> list[RequestStream]:
        """As EngineClient.submit, on the replica the router picks; a replica that dies before it accepted the
        batch hands it to another live one (nothing of it was sent to the client yet). While no replica is up
        (each dead and being started again) it waits up to REPLICA_WAIT_S for one, then EngineDead."""
        if self.num_waiting() >= self.max_waiting:
            raise Overloaded(f"{self.num_waiting()} requests are waiting (--max-waiting-requests "
                             f"{self.max_waiting}); try again later")
        streams = None
        if isinstance(params, SamplingParams) and params.output_kind == RequestOutputKind.FINAL_ONLY:
            params, streams = _as_whole_streams(params, len(request_ids))
        return await self._place(request_ids, prompts, params, priority, lora, streams)

    async def _place(self, request_ids, prompts, params, priority, lora, streams=None, avoid=(), resume=None,
                     moves: int = 0, kv=None, roles=PREFILLS) -> list:
        """Submit to the replica the router picks among those of `roles` (any live one while none of those is up).
        A streamed request placed on a prefill replica leaves it after its first tokens (_handoff)."""
        lora_id = lora[1] if lora else None
        tried = set(avoid)
        deadline = time.monotonic() + REPLICA_WAIT_S
        while True:
            loads = self._loads(lora_id)
            for i in tried:
                loads[i].alive = False
            if any(load.alive and self.roles[i] in roles for i, load in enumerate(loads)):
                for i, load in enumerate(loads):
                    load.alive = load.alive and self.roles[i] in roles
            try:
                replica = self.router.route(prompts[0], loads, lora_id)
            except NoReplica:       # every replica down: the server is starting one again (or exits), so wait
                if time.monotonic() >= deadline or any(c.shut_down for c in self.replicas):   # none will come
                    raise EngineDead(self.dead or "no replica could take the request") from None
                tried = {i for i in tried if self.replicas[i].dead is None}      # a dead one may come back
                await asyncio.sleep(WAIT_POLL_S)
                continue
            self._sent[replica] += 1
            # where they run is known before the replica's answer: its outputs, even its hand-off, may come first
            for rid, prompt in zip(request_ids, prompts):
                self._owner[rid] = Placed(replica, prompt, params, priority, lora, moves)
            try:
                handoff = self._handoff_kv if (
                    self.roles[replica] == "prefill" and params.output_kind == RequestOutputKind.DELTA
                    and any(c.dead is None and self.roles[i] in DECODES for i, c in enumerate(self.replicas))) else None
                streams = await self.replicas[replica].submit(request_ids, prompts, params, priority, lora, streams,
                                                              resume, kv, handoff)
            except BaseException as exc:
                for rid in request_ids:
                    self._owner.pop(rid, None)
                if not isinstance(exc, EngineDead):
                    raise
                tried.add(replica)
                continue
            finally:
                self._sent[replica] -= 1
            if lora_id is not None:
                self._loras[replica].add(lora_id)
            return streams

    def _rescue(self, streams: dict[str, RequestStream], why: str) -> set[str]:
        """A replica stopped (EngineClient.fail_all): its open requests go to another live replica. Those none of
        whose output was read run again from their start, each batch as it was submitted; a stream read in part
        is resumed where its client is (its prompt and each unfinished completion's tokens so far: engine/
        resume.py), so the client's stream goes on; a non-streamed one from every token it was sent. Returns the
        ids taken over (the rest fail with `why`); one that finds no replica fails then."""
        batches: dict[tuple, list[str]] = {}
        taken, moves = set(), []
        for rid, stream in streams.items():
            placed = self._owner.get(rid)
            if placed is None or placed.moves >= MAX_MOVES:     # a request that stops every replica it runs on
                continue
            payload = self.replicas[placed.replica].migrated.get(rid)      # a restart's export, with its KV
            kept = stream.whole and stream.pending is not None     # a whole answer's pieces stay: it goes on from them
            if not kept and not stream.read and (payload is None or stream.progress is None):
                key = (placed.replica, id(placed.params), placed.priority, id(placed.lora))
                batches.setdefault(key, []).append(rid)
            elif (resume := _resume_state(stream, placed.params.n, unread=kept)) is not None:
                if not kept:
                    stream.restart()
                taken.add(rid)
                moves.append(asyncio.ensure_future(self._resubmit(
                    [rid], [placed.prompt], placed, [stream], why, [resume], None if payload is None else [payload])))
        for ids in batches.values():
            first = self._owner[ids[0]]
            for stream in (streams[rid] for rid in ids):
                stream.restart()
            asyncio.ensure_future(self._resubmit(ids, [self._owner[rid].prompt for rid in ids], first,
                                                 [streams[rid] for rid in ids], why))
            taken.update(ids)
        for client in self.replicas:       # a restarting replica whose migrated KV stays in its pool: it may go
            if client.migrated:            # once the replicas its requests moved to have copied it
                asyncio.ensure_future(_release_after(client, moves))
        return taken

    async def _resubmit(self, ids: list[str], prompts: list, placed: Placed, streams: list, why: str,
                        resume: list | None = None, kv: list | None = None, handoff: bool = False,
                        rebalanced: bool = False) -> None:
        """Place requests of a replica that stopped (or, `handoff`, that a prefill replica handed over: onto a
        decode replica; `rebalanced`: that a replica that queues handed over, onto another) elsewhere; the ones
        no replica takes fail with `why`."""
        self._moving.update(ids)
        try:
            await self._place(ids, prompts, placed.params, placed.priority, placed.lora, streams,
                              avoid=() if handoff and not rebalanced else (placed.replica,), resume=resume,
                              moves=placed.moves + (not handoff), kv=kv, roles=DECODES if handoff else PREFILLS)
            gone = self._abandoned.intersection(ids)      # their clients left while they moved
            self._moving.difference_update(ids)
            self._abandoned.difference_update(ids)
            self.abort(gone)
            if rebalanced:
                self.num_rebalanced += len(ids)
                return
            if handoff:
                self.num_handed_off += len(ids)
                self.kv_bytes_handed_off += sum(len(raw) for raw in kv)
                return
            if resume is None:
                self.num_resubmitted += len(ids)
            else:
                self.num_resumed += len(ids)
            if kv is not None:
                self.num_migrated += len(ids)
                self.kv_bytes_migrated += sum(len(raw) for raw in kv)
            log.warning("%d request(s) of replica %d %s on another replica", len(ids), placed.replica,
                        "run again" if resume is None else "resumed" if kv is None else "moved with their KV")
        except Exception as exc:                 # no live replica (or it refused): they end as the others did
            self._moving.difference_update(ids)
            self._abandoned.difference_update(ids)
            for rid, stream in zip(ids, streams):
                self._owner.pop(rid, None)
                stream.fail(EngineDead(why if isinstance(exc, EngineDead) else f"{why}; {exc}"))

    def _rebalance(self) -> None:
        """Move running streams off a replica that queues to those with room (the module's note): called as each
        replica's figures come in, looking at most every REBALANCE_EVERY_S."""
        now = time.monotonic()
        if not self.rebalance or now < self._rebalance_at:
            return
        self._rebalance_at = now + REBALANCE_EVERY_S
        self._rebalancing.intersection_update(self._owner)       # those that finished before they moved
        loads = self._loads(None)
        decodes = [i for i, load in enumerate(loads) if load.alive and self.roles[i] in DECODES]
        room = [i for i in decodes if loads[i].waiting == 0 and loads[i].pending == 0 and loads[i].kv_usage < 0.5
                and (not loads[i].max_seqs or loads[i].running < loads[i].max_seqs)]
        if not room:
            return
        busy = {self._owner[rid].replica for rid in self._rebalancing}
        for i in decodes:
            load = loads[i]
            if i in room or i in busy or load.waiting == 0 or load.running == 0:
                continue
            ids = [rid for rid in self.replicas[i].movable() if rid not in self._moving]
            ids = ids[-min(load.waiting, MAX_REBALANCE):]
            if not ids:
                continue
            self._rebalancing.update(ids)
            log.info("rebalancing: replica %d queues %d request(s): %d of its streams move to replica(s) %s",
                     i, load.waiting, len(ids), ", ".join(map(str, room)))
            asyncio.ensure_future(self.replicas[i].move(ids, self._handoff_kv))

    def _handoff(self, rid: str, stream: RequestStream, payload: bytes) -> None:
        """A prefill replica handed request `rid` over with its KV, after the outputs of its first tokens: it goes
        on on a decode replica from every token its stream was given (read or not), the stream the same."""
        placed = self._owner.get(rid)
        resume = None if placed is None else _resume_state(stream, placed.params.n, unread=True)
        if resume is None:        # its client left, or nothing is left to decode: it ends here
            if placed is not None:
                self._owner.pop(rid, None)
                stream.fail(EngineDead(f"replica {placed.replica} handed over a request it could not resume"))
            return
        self._moving.add(rid)         # an abort from now on finds it on its way
        rebalanced = rid in self._rebalancing
        self._rebalancing.discard(rid)
        asyncio.ensure_future(self._resubmit([rid], [placed.prompt], placed, [stream],
                                             f"replica {placed.replica} handed the request over", [resume],
                                             [payload], handoff=True, rebalanced=rebalanced))

    async def lora(self, op: str, lora: list) -> None:
        """Every live replica loads (checks) or unloads the adapter; the first refusal propagates."""
        live = [c for c in self.replicas if c.dead is None]
        if not live:
            raise EngineDead(self.dead)
        await asyncio.gather(*(c.lora(op, lora) for c in live))
        if op == "lora_unload":
            for held in self._loras:
                held.discard(lora[1])

    def abort(self, request_ids) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            placed = self._owner.pop(rid, None)
            if rid in self._moving:
                self._abandoned.add(rid)        # aborted where it lands
            elif placed is not None:
                by_replica.setdefault(placed.replica, []).append(rid)
        for replica, ids in by_replica.items():
            self.replicas[replica].abort(ids)

    def fail_all(self, why: str, shutdown: bool = False) -> None:
        for client in self.replicas:
            client.fail_all(why, shutdown)

    def replica_died(self, replica: int) -> None:
        """Its requests failed or moved (EngineClient did that); its cache is gone: the router forgets it."""
        self.router.forget_replica(replica)
        self._loras[replica].clear()
        for rid in [r for r, placed in self._owner.items() if placed.replica == replica]:
            del self._owner[rid]


def _as_whole_streams(params: SamplingParams, count: int) -> tuple[SamplingParams, list[RequestStream]]:
    """A non-streamed request's parameters and streams between the processes: its engine sends DELTA outputs,
    which its stream merges into the one final output its handler reads (RequestStream's `whole`), so that a
    prefill replica can hand it over, rebalancing move it, and a stopped replica's export resume it, each with
    its KV, as a streamed request; its handler sees the final output as before."""
    delta = copy.copy(params)
    delta.output_kind = RequestOutputKind.DELTA
    ready = asyncio.Event()
    return delta, [RequestStream(RequestOutputKind.DELTA, ready, track=True, whole=True) for _ in range(count)]


def _resume_state(stream: RequestStream, n: int, unread: bool = False) -> list | None:
    """The wire's resume entry of a stream read in part: [index, token ids, characters] of each completion not
    finished yet (none read yet: from nothing), or None when it cannot be resumed (not a tracked delta stream).
    `unread`: from every token the stream was given, its unread output too (a prefill replica's hand-off: what is
    unread stays in the stream and reaches the client)."""
    if stream.progress is None:
        return None
    progress = stream.progress
    if unread and stream.pending is not None:
        progress = {i: [list(ids), chars, finished] for i, (ids, chars, finished) in progress.items()}
        add_progress(progress, stream.pending)
    rows, done_tokens = [], 0
    for index in range(n):
        ids, chars, finished = progress.get(index, ([], 0, False))
        if finished:
            done_tokens += len(ids)
        else:
            rows.append([index, list(ids), chars])
    if not rows:
        return None
    stream.extra_tokens = done_tokens
    return rows


async def _release_after(client, moves: list) -> None:
    """Once these resubmissions have been accepted (the replicas they went to copied their KV then) or failed,
    tell the restarting replica `client` it may exit."""
    await asyncio.gather(*moves, return_exceptions=True)
    await client.release()
