"""Plan broadcast channel: rank 0 publishes one encoded step plan per engine step to every
worker rank, in order.  Same-node workers read a shared-memory ring (``shm_ring``), other
nodes read a ZMQ PUB/SUB link (``zmq_link``); every reader also holds a PUSH back channel
to the writer (hello, heartbeats, error reports, bye; msgpack, never pickle).

Bootstrap goes through ``store`` (``set``/blocking ``get``; torch's TCPStore fits): the
writer publishes one msgpack record under ``<key>/meta``; readers announce themselves
(pid, process start time) on the back channel and the first ``publish`` waits for all of
them, so no remote reader can miss an early plan (ZMQ slow joiner).

Liveness: shm readers watch the writer's pid (with its start time, so zombies and reused
pids count as dead; checked every 0.2 s while waiting) or, where that pid is not visible
(another pid namespace), a heartbeat counter the writer's monitor thread bumps every second
in the ring header; ZMQ readers expect a heartbeat frame every second.  The writer's monitor
thread watches local readers' pids (or heartbeats, same rule) and remote readers'
back-channel heartbeats; deaths and reported errors surface as ``PeerError`` from
``check_readers`` and ``publish``.  Idle is not death: heartbeats flow without plans.  A
reader that sees its writer's process gone unlinks the writer's segments (``nvtp_<pid>_<token>_*``);
a writer that exits normally or via ``close`` unlinks them itself (atexit as well).

Trust: every ZMQ socket runs CURVE with keys derived from the engine secret, and the writer's gatekeeper
(``zmq_link.Gatekeeper``) admits only its readers' keys; the bootstrap record is signed with the same secret,
and readers attach only to segments private to their user. ZMQ is imported only when a channel is opened.
"""
from __future__ import annotations

import atexit
import logging
import os
import secrets
import socket
import threading
import time

from .channel_common import (_CHECK_S, _MAX_NAP_S, KIND_DATA, KIND_HEARTBEAT, KIND_SHUTDOWN, ChannelClosed,
                             ChannelError, ChannelLagged, ChannelTimeout, PeerError, proc_start_time, sign_meta)
from .channel_reader import PlanReader
from .shm_ring import ShmRingWriter
from .trust import ChannelKeys

log = logging.getLogger("nanovllm_tp")
_yield_cpu = getattr(os, "sched_yield", lambda: None)
__all__ = ["PlanWriter", "PlanReader", "ChannelError", "ChannelClosed", "ChannelTimeout", "ChannelLagged",
           "PeerError"]


class PlanWriter:
    """Rank 0's end of the plan channel. ``host`` must be an address of this node that the
    readers (remote ones included) can reach; ZMQ picks free ports on it. Not thread-safe:
    one thread publishes. ``secret`` (shared with every reader) keys CURVE on every socket and signs
    the bootstrap record; None runs the channel unauthenticated (benchmarks only)."""

    def __init__(self, store, local_ranks: list[int], remote_ranks: list[int], *, secret: bytes | None,
                 num_slots: int = 8, slot_bytes: int = 1 << 20, host: str = "127.0.0.1", key: str = "nvtp_plan",
                 reader_timeout_s: float = 8.0, join_timeout_s: float = 120.0, heartbeat_s: float = 1.0,
                 hwm: int | None = None):
        import zmq

        from .zmq_link import PLAN_HWM, BackServer, Gatekeeper, PubLink
        self._local, self._remote = [int(r) for r in local_ranks], [int(r) for r in remote_ranks]
        self._ranks = set(self._local) | set(self._remote)
        if len(self._ranks) != len(self._local) + len(self._remote):
            raise ValueError("a rank is listed twice")
        self._reader_timeout, self._join_timeout, self._hb = reader_timeout_s, join_timeout_s, heartbeat_s
        self._pid = os.getpid()
        self._seq, self._shut, self._closed, self._ready = 0, False, False, False
        self._peers: dict[int, dict] = {}
        self._failures: list[tuple[int, str, bool]] = []  # (rank, text, reported by the reader)
        self._joined, self._stop = threading.Event(), threading.Event()
        self._ring = self._pub = self._back = self._gate = None
        self._dropped_logged, self._drop_log_due = 0, 0.0
        keys = ChannelKeys(secret) if secret is not None else None
        self._ctx = zmq.Context()
        try:
            self._gate = Gatekeeper(self._ctx, keys, self._ranks)   # ZAP handler first: it vets every handshake
            prefix = f"nvtp_{self._pid}_{secrets.token_hex(4)}"
            if self._local:
                self._ring = ShmRingWriter(prefix, num_slots, slot_bytes, len(self._local))
            if self._remote:
                self._pub = PubLink(self._ctx, host, keys, hwm or PLAN_HWM)
                self._gate.watch(self._pub.socket)
            self._back = BackServer(self._ctx, host, keys, self._gate.counts)
            self._gate.watch(self._back.socket)
            meta = {"v": 2, "prefix": prefix, "shm": self._ring.name if self._ring else None,
                    "local": self._local, "remote": self._remote, "pid": self._pid,
                    "start": proc_start_time(self._pid), "host": socket.gethostname(),
                    "pub": self._pub.endpoint if self._pub else None, "back": self._back.endpoint,
                    "hwm": hwm or PLAN_HWM}
            store.set(f"{key}/meta", sign_meta(meta, secret))
        except BaseException:
            self._release()
            raise
        if not self._ranks:
            self._joined.set()
        self._thread = threading.Thread(target=self._monitor, name="nvtp-plan-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    # -- data path ----------------------------------------------------------------
    def publish(self, payload, *, timeout: float | None = None) -> None:
        """Send the next plan to every reader. Blocks only while the ring slot it needs is
        still unread (raising PeerError if a reader dies, ChannelTimeout after ``timeout``)."""
        if self._shut or self._closed:
            raise ChannelClosed("publish after shutdown/close")
        if self._failures:
            self.check_readers()
        if not self._ready:
            self._wait_joined()
            self._ready = True
        if not isinstance(payload, (bytes, bytearray)):
            payload = memoryview(payload).cast("B")
        seq = self._seq + 1
        ring = self._ring
        if ring is not None:
            if not ring.slot_free(seq):
                self._wait_slot(seq, timeout)
            ring.write(seq, payload)
            ring.collect_overflow()
        if self._pub is not None:
            self._pub.send(KIND_DATA, seq, payload)
        self._seq = seq

    def _wait_joined(self) -> None:
        deadline = time.monotonic() + self._join_timeout
        while not self._joined.wait(0.05):
            if self._failures:
                self.check_readers()
            if time.monotonic() > deadline:
                missing = sorted(self._ranks - set(self._peers))
                raise ChannelTimeout(f"readers {missing} did not connect within {self._join_timeout} s")

    def _wait_slot(self, seq: int, timeout: float | None) -> None:
        ring, t0 = self._ring, time.perf_counter()
        deadline = None if timeout is None else t0 + timeout
        nap = 20e-6
        while not ring.slot_free(seq):
            if self._failures:
                self.check_readers()
            now = time.perf_counter()
            if deadline is not None and now > deadline:
                lag = [self._local[i] for i in ring.laggards(seq)]
                raise ChannelTimeout(f"readers {lag} have not consumed plan {seq - ring.num_slots}")
            if now - t0 > 0.002:
                time.sleep(nap)
                nap = min(nap * 2, _MAX_NAP_S)
            else:
                _yield_cpu()  # a reader may need this core to catch up
            ring.collect_overflow()

    # -- control --------------------------------------------------------------------
    def shutdown(self, reason: str = "") -> None:
        """Tell every reader to stop: their ``receive`` raises ChannelClosed(reason) once they
        have consumed the plans published before. Idempotent."""
        if self._shut or self._closed:
            return
        self._shut = True
        if self._ring is not None:
            self._ring.set_closed(reason)
        if self._pub is not None:
            self._pub.send(KIND_SHUTDOWN, self._seq, reason.encode("utf-8", "replace"))

    def check_readers(self) -> None:
        """Raise PeerError for the first reader that reported an error, died or left
        (deaths after ``shutdown`` are expected and ignored)."""
        for rank, text, reported in list(self._failures):
            if reported or not self._shut:
                raise PeerError(rank, text)

    def silent_death(self) -> PeerError | None:
        """The first reader that died or left without reporting an error, if any: where one rank's death makes its
        peers fail (a pipeline stage waiting on it, an all-reduce), their reports name the victims, this the
        cause."""
        reporters = {rank for rank, _, reported in self._failures if reported}
        for rank, text, reported in list(self._failures):
            if not reported and rank not in reporters:
                return PeerError(rank, text)
        return None

    def close(self) -> None:
        """Shut down (if not done), stop the monitor, unlink every segment. Idempotent."""
        if self._closed or os.getpid() != self._pid:
            return
        self.shutdown("writer closed")
        self._closed = True
        self._stop.set()
        self._thread.join(timeout=5)
        self._release()
        atexit.unregister(self.close)

    @property
    def dropped(self) -> dict:
        """What the channel turned away: failed handshakes (no or wrong keys, random bytes), unknown client
        keys, and back-channel messages that were malformed or spoke for another rank."""
        return dict(self._gate.counts) if self._gate is not None else {}

    def _release(self) -> None:
        if self._ring is not None:
            self._ring.close()
        if self._gate is not None:
            self._gate.close()
        for link in (self._pub, self._back):
            if link is not None:
                link.close()
        self._ctx.term()

    # -- monitor thread -------------------------------------------------------------
    def _monitor(self) -> None:
        import zmq
        poller = zmq.Poller()
        back = self._back.socket
        for sock in [back] + self._gate.sockets():
            poller.register(sock, zmq.POLLIN)
        hb_due = check_due = 0.0
        while not self._stop.is_set():
            wait = min(0.1, max(0.0, hb_due - time.monotonic()))
            for sock, _ in poller.poll(int(wait * 1000)):
                if sock is back:
                    for msg in self._back.drain():
                        self._on_message(msg)
                else:
                    self._gate.handle(sock)
            now = time.monotonic()
            self._log_drops(now)
            if now >= hb_due:
                if self._ring is not None:
                    self._ring.beat()
                if self._pub is not None:
                    self._pub.send(KIND_HEARTBEAT, self._seq)
                hb_due = now + (self._hb if self._joined.is_set() else 0.02)
            if now >= check_due:
                self._check_peers(now)
                check_due = now + _CHECK_S

    def _log_drops(self, now: float) -> None:
        self._gate.tick(now)
        total = sum(self._gate.counts.values())
        if total > self._dropped_logged and now >= self._drop_log_due:
            log.warning("plan channel: turned away unauthenticated or malformed traffic: %s", self._gate.counts)
            self._dropped_logged, self._drop_log_due = total, now + 5.0

    def _on_message(self, msg: dict) -> None:
        rank, kind, now = msg.get("rank"), msg.get("t"), time.monotonic()
        if rank not in self._ranks:
            self._gate.counts["forged"] += 1
            return
        if kind == "hello":
            pid, start = msg.get("pid"), msg.get("start")
            # pid-based liveness only where the pid names the same process here (same pid
            # namespace); otherwise fall back to heartbeats.
            by_pid = rank in self._local and start is not None and proc_start_time(pid) == start
            self._peers[rank] = {"pid": pid if by_pid else None, "start": start, "last": now}
            if len(self._peers) == len(self._ranks):
                self._joined.set()
            return
        peer = self._peers.get(rank)
        if peer is None:
            return
        peer["last"] = now
        if kind == "err":
            self._failures.append((rank, str(msg.get("text", "")), True))
        elif kind == "bye":
            peer["gone"] = "reader closed the channel"

    def _check_peers(self, now: float) -> None:
        for rank, peer in list(self._peers.items()):
            if peer.get("dead"):
                continue
            why = peer.get("gone")
            if why is None and peer["pid"] is not None:
                if proc_start_time(peer["pid"]) != peer["start"]:
                    why = f"reader process {peer['pid']} died"
            elif why is None and now - peer["last"] > self._reader_timeout:
                why = f"no heartbeat from reader for {now - peer['last']:.1f} s"
            if why is not None:
                peer["dead"] = True
                self._failures.append((rank, why, False))
