"""Reader side of the plan channel (see ``channel.py`` for the protocol)."""
from __future__ import annotations

import atexit
import os
import socket
import threading
import time

from .channel_common import (_CHECK_S, _MAX_NAP_S, KIND_DATA, KIND_SHUTDOWN, ChannelClosed, ChannelLagged,
                             ChannelTimeout, open_meta, proc_start_time)
from .shm_ring import ShmRingReader, unlink_by_prefix
from .trust import ChannelKeys

yield_cpu = getattr(os, "sched_yield", lambda: None)


class PlanReader:
    """One worker rank's end of the plan channel. ``local`` must match how the writer listed
    this rank and ``secret`` the writer's. Not thread-safe: one thread calls ``receive``."""

    def __init__(self, store, rank: int, local: bool, *, secret: bytes | None, writer_timeout_s: float = 8.0,
                 key: str = "nvtp_plan", spin_s: float = 0.05, heartbeat_s: float = 1.0):
        import zmq

        from .zmq_link import PLAN_HWM, BackClient, SubLink
        meta = open_meta(store.get(f"{key}/meta"), secret)
        keys = ChannelKeys(secret) if secret is not None else None
        self._hwm = meta.get("hwm")
        ranks = meta["local"] if local else meta["remote"]
        if rank not in ranks:
            raise ValueError(f"rank {rank} is not a {'local' if local else 'remote'} reader of this channel")
        self.rank, self._timeout, self._spin_s, self._hb = rank, writer_timeout_s, spin_s, heartbeat_s
        self._prefix, self._closed_reason, self._pending = meta["prefix"], None, None
        self._ring = self._sub = self._back = None
        self._writer_pid = self._writer_start = None
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        try:
            self._back = BackClient(self._ctx, meta["back"], keys, rank)
            if local:
                try:
                    self._ring = ShmRingReader(meta["shm"], ranks.index(rank))
                except FileNotFoundError:
                    raise ChannelClosed(f"plan ring {meta['shm']} is gone (writer exited)") from None
                if meta["start"] is not None and proc_start_time(meta["pid"]) == meta["start"]:
                    self._writer_pid, self._writer_start = meta["pid"], meta["start"]
                    atexit.register(self._clean_up_after_dead_writer)
                self._last_hb = self._ring.heartbeat()
            else:
                self._sub, self._expect = SubLink(self._ctx, meta["pub"], keys, rank, self._hwm or PLAN_HWM), 1
                frame = self._sub.recv(writer_timeout_s)  # proves our subscription is live
                if frame is None:
                    raise ChannelClosed(f"writer at {meta['pub']} unreachable")
                self._pending = self._on_frame(*frame)
            self._last_alive = time.monotonic()
            self._back.send({"t": "hello", "rank": rank, "pid": os.getpid(),
                             "start": proc_start_time(os.getpid()), "host": socket.gethostname()})
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._beat, name="nvtp-plan-reader", daemon=True)
        self._thread.start()

    def receive(self, timeout: float | None = None) -> bytes:
        """Next plan. ChannelClosed on shutdown / dead writer, ChannelTimeout after ``timeout``."""
        if self._closed_reason is not None:
            raise ChannelClosed(self._closed_reason)
        if self._ring is not None:
            return self._receive_shm(timeout)
        return self._receive_zmq(timeout)

    def _receive_shm(self, timeout: float | None) -> bytes:
        poll = self._ring.poll
        data = poll()
        if data is not None:
            return data
        t0 = time.perf_counter()
        spin_end, check_due = t0 + self._spin_s, t0 + _CHECK_S
        deadline = None if timeout is None else t0 + timeout
        # Small batches: under CPU contention every yield may cost a whole time slice, so the
        # shutdown flag and the clock are looked at every few polls, not every few hundred.
        spins, nap = 8, 20e-6
        try:
            while True:
                for _ in range(spins):  # tight poll on the slot header
                    data = poll()
                    if data is not None:
                        return data
                    yield_cpu()  # lets the writer run first when cores are oversubscribed
                now = time.perf_counter()
                reason = self._ring.closed_reason()
                if reason is not None:
                    data = poll()  # plans published before the shutdown come first
                    if data is not None:
                        return data
                    self._fail(reason)
                if now >= check_due:
                    data = self._check_writer_shm()
                    if data is not None:
                        return data
                    check_due = now + _CHECK_S
                if deadline is not None and now >= deadline:
                    raise ChannelTimeout(f"no plan within {timeout} s")
                if now >= spin_end:  # idle: back off to short sleeps
                    spins = 1
                    time.sleep(nap)
                    nap = min(nap * 2, _MAX_NAP_S)
        except FileNotFoundError:
            self._fail("writer removed the plan ring")

    def _check_writer_shm(self) -> bytes | None:
        now = time.monotonic()
        if self._writer_pid is not None and proc_start_time(self._writer_pid) != self._writer_start:
            data = self._ring.poll()  # a plan completed just before the death is still valid
            if data is not None:
                return data
            self._clean_up_after_dead_writer()
            self._fail(f"writer process {self._writer_pid} died")
        if self._writer_pid is not None:
            return None  # the pid is authoritative; a writer busy holding the GIL is not dead
        hb = self._ring.heartbeat()
        if hb != self._last_hb:
            self._last_hb, self._last_alive = hb, now
        elif now - self._last_alive > self._timeout:
            self._fail(f"no heartbeat from writer for {now - self._last_alive:.1f} s")
        return None

    def writer_gone(self) -> str | None:
        """Why rank 0 is known to be gone (its process died), or None: a failure of this rank that follows from it
        (a collective with the dead rank) is its consequence, not an error of its own."""
        if self._writer_pid is not None and proc_start_time(self._writer_pid) != self._writer_start:
            return f"writer process {self._writer_pid} died"
        return None

    def _clean_up_after_dead_writer(self) -> None:
        """A dead writer cannot unlink its segments any more: its ring and overflow segments and its shm
        all-reduce, all named ``nvtp_<writer pid>_*``. Checked whenever this rank finds it dead, on close, and at
        exit (a rank that failed first, in a collective with it, may only see it dead once it is reaped)."""
        if self._writer_pid is not None and proc_start_time(self._writer_pid) != self._writer_start:
            unlink_by_prefix(f"nvtp_{self._writer_pid}_")

    def _receive_zmq(self, timeout: float | None) -> bytes:
        if self._pending is not None:
            data, self._pending = self._pending, None
            return data
        t0 = time.monotonic()
        deadline = None if timeout is None else t0 + timeout
        while True:
            wait = _CHECK_S if deadline is None else max(0.0, min(_CHECK_S, deadline - time.monotonic()))
            frame = self._sub.recv(wait)
            now = time.monotonic()
            if frame is not None:
                self._last_alive = now
                data = self._on_frame(*frame)
                if data is not None:
                    return data
            elif now - self._last_alive > self._timeout:
                self._fail(f"no heartbeat from writer for {now - self._last_alive:.1f} s")
            if deadline is not None and now >= deadline:
                raise ChannelTimeout(f"no plan within {timeout} s")

    def _on_frame(self, kind: int, seq: int, payload: bytes) -> bytes | None:
        if kind == KIND_SHUTDOWN:
            self._fail(payload.decode("utf-8", "replace"))
        if kind != KIND_DATA:
            return None
        if seq != self._expect:
            text = (f"rank {self.rank} fell behind: plans {self._expect}..{seq - 1} were dropped by the writer "
                    f"after {self._hwm} unread plans queued for it")
            self._closed_reason = text
            raise ChannelLagged(text)
        self._expect = seq + 1
        return payload

    def _fail(self, reason: str):
        self._closed_reason = reason
        raise ChannelClosed(reason)

    def report_error(self, text: str) -> None:
        """Best effort: the writer's check_readers()/publish() raise PeerError(rank, text)."""
        if self._back is not None:
            self._back.send({"t": "err", "rank": self.rank, "text": str(text)[:65536]})

    def _beat(self) -> None:
        while not self._stop.wait(self._hb):
            self._back.send({"t": "hb", "rank": self.rank})

    def close(self) -> None:
        if self._ctx is None:
            return
        self._stop.set()
        if getattr(self, "_thread", None) is not None:
            self._thread.join(timeout=5)
        if self._back is not None and self._closed_reason is None:
            self._back.send({"t": "bye", "rank": self.rank})
        if self._closed_reason is None:
            self._closed_reason = "reader closed"
        if self._back is not None:
            self._back.close()
        for part in (self._sub, self._ring):
            if part is not None:
                part.close()
        self._clean_up_after_dead_writer()
        self._ctx.term()
        self._ctx = None
