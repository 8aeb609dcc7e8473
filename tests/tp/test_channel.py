"""Plan channel (shared-memory ring + ZMQ) tests with real processes and a real TCPStore."""
from __future__ import annotations

import json
from multiprocessing import connection as mp_connection
import os
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from datetime import timedelta

import msgpack
import pytest

torch_dist = pytest.importorskip("torch.distributed")

from nanovllm_tp.distributed.channel import (ChannelClosed, ChannelError, ChannelLagged,  # noqa: E402
                                             ChannelTimeout, PeerError, PlanReader, PlanWriter)
from nanovllm_tp.distributed.trust import ChannelKeys  # noqa: E402

KEY = "test_plan"  # every test has its own store, so one key suffices
SECRET = b"test-secret-" + b"0123456789abcdef" * 3  # the engine makes a fresh one; tests share this one
_HEAD = struct.Struct("<QI")  # plan number, crc32 of the body


def make_plan(i: int, size: int) -> bytes:
    body = (i.to_bytes(8, "little") * (size // 8 + 1))[:size] if size < 65536 else os.urandom(size)
    return _HEAD.pack(i, zlib.crc32(body)) + body


def check_plan(data: bytes, expect: int) -> int:
    i, crc = _HEAD.unpack_from(data)
    assert isinstance(data, bytes) and i == expect and zlib.crc32(data[_HEAD.size:]) == crc, (i, expect)
    return len(data)


def _client(port: int):
    return torch_dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30))


# ---------------------------------------------------------------- child process targets
def reader_proc(q, port, key, rank, local, n, delay=0.0, report=None, then="close"):
    """Receive and verify n plans, report; then wait for shutdown ('close') or hang ('hang')."""
    try:
        reader = PlanReader(_client(port), rank, local, key=key, secret=SECRET)
        sizes = []
        for i in range(1, n + 1):
            sizes.append(check_plan(reader.receive(timeout=30), i))
            if delay:
                time.sleep(delay)
        q.put(("done", rank, sizes))
        if report is not None:
            reader.report_error(report)
        if then == "hang":
            time.sleep(120)
        time.sleep(0.3)  # idle long enough to be napping, not spinning (spin_s = 0.05)
        try:
            reader.receive(timeout=30)
            q.put(("error", rank, "plan after the last one"))
        except ChannelClosed as e:
            q.put(("closed", rank, str(e), time.monotonic()))
        reader.close()
    except BaseException as e:  # surfaced by the test through the queue
        q.put(("error", rank, repr(e)))


def lagging_reader_proc(q, port, key, rank, pause):
    """Take plan 1, stop reading for ``pause`` seconds, then read until the stream reports the gap."""
    try:
        reader = PlanReader(_client(port), rank, False, key=key, secret=SECRET)
        check_plan(reader.receive(timeout=30), 1)
        q.put(("first", rank))
        time.sleep(pause)
        got = 1
        try:
            while True:
                check_plan(reader.receive(timeout=30), got + 1)
                got += 1
        except ChannelLagged as e:
            q.put(("lagged", rank, str(e), got))
        reader.close()
    except BaseException as e:  # surfaced by the test through the queue
        q.put(("error", rank, repr(e)))


def writer_proc(q, port, key, n):
    writer = PlanWriter(_client(port), [1], [2], key=key, secret=SECRET)
    for i in range(1, n + 1):
        writer.publish(make_plan(i, 100 * i))
    q.put(("published", 0))
    time.sleep(120)  # killed by the test


def writer_exit_proc(q, port, key):
    writer = PlanWriter(_client(port), [1], [], key=key, secret=SECRET)  # never closed: atexit must clean up
    q.put(("created", 0, writer._ring.name))


# ---------------------------------------------------------------- process pool
# A fresh child spends seconds importing torch (for TCPStore).  The pool keeps two children that
# have already imported this module; each runs exactly one job and exits, and a replacement starts
# warming up as soon as one is taken.  Children are plain subprocesses; jobs and results travel as
# length-prefixed msgpack frames over two extra pipes (nothing is pickled).
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_FRAME = struct.Struct("<I")


def _read_exact(f, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = f.read(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


class _FdConn:
    """send_bytes / recv_bytes over a pair of pipe fds; fileno() lets multiprocessing.connection.wait poll it."""

    def __init__(self, read_fd: int, write_fd: int):
        self.r = os.fdopen(read_fd, "rb", buffering=0)
        self.w = os.fdopen(write_fd, "wb", buffering=0)

    def fileno(self) -> int:
        return self.r.fileno()

    def send_bytes(self, data: bytes) -> None:
        self.w.write(_FRAME.pack(len(data)) + data)

    def recv_bytes(self) -> bytes:
        (n,) = _FRAME.unpack(_read_exact(self.r, _FRAME.size))
        return _read_exact(self.r, n)

    def close(self) -> None:
        for f in (self.r, self.w):
            try:
                f.close()
            except OSError:
                pass


def _child_entry(read_fd: int, write_fd: int) -> None:
    _pool_main(_FdConn(read_fd, write_fd))


def _pool_main(conn):
    try:
        job = msgpack.unpackb(conn.recv_bytes())
    except EOFError:
        return
    fn, args = job
    globals()[fn](_PipeQ(conn), *args)


class _PipeQ:
    def __init__(self, conn):
        self.conn = conn

    def put(self, msg):
        self.conn.send_bytes(msgpack.packb(msg, use_bin_type=True))


class _Child:
    """A pooled subprocess with the small part of multiprocessing.Process's interface the tests use."""

    def __init__(self):
        job_r, job_w = os.pipe()
        msg_r, msg_w = os.pipe()
        code = (f"import sys; sys.path.insert(0, {REPO!r}); "
                f"from tests.tp.test_channel import _child_entry; _child_entry({job_r}, {msg_w})")
        self.proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=(job_r, msg_w), cwd=REPO)
        os.close(job_r)
        os.close(msg_w)
        self.conn = _FdConn(msg_r, job_w)
        self.pid = self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout=None) -> None:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self) -> None:
        self.proc.kill()

    def terminate(self) -> None:
        self.proc.terminate()

    @property
    def exitcode(self):
        return self.proc.poll()


class _Pool:
    def __init__(self, size: int, budget: int):
        self.idle, self.all, self.budget = [], [], budget
        for _ in range(min(size, budget)):
            self._add()

    def _add(self):
        child = _Child()
        self.idle.append((child, child.conn))
        self.all.append(child)

    def take(self):
        if not self.idle:
            self._add()
        proc, conn = self.idle.pop(0)
        if len(self.all) < self.budget:  # warm a replacement, but none that no test will use
            self._add()
        return proc, conn

    def close(self):
        for proc in self.all:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
            proc.conn.close()


_CHILDREN_USED = 11  # children the tests below take from the pool (more are started on demand)


@pytest.fixture(scope="module")
def pool():
    p = _Pool(size=2, budget=_CHILDREN_USED)
    yield p
    p.close()


def _our_segments(pids) -> set[str]:
    out = set()
    for name in os.listdir("/dev/shm"):
        parts = name.split("_")
        if name.startswith("nvtp_") and len(parts) > 1 and parts[1].isdigit() and int(parts[1]) in pids:
            out.add(name)
    return out


class _Spawner:
    """Runs target functions in pooled processes; kills them at teardown, whatever happened."""

    def __init__(self, pool):
        self.pool, self.procs, self.conns = pool, [], []

    def __call__(self, target, *args):
        proc, conn = self.pool.take()
        conn.send_bytes(msgpack.packb((target.__name__, args), use_bin_type=True))
        self.procs.append(proc)
        self.conns.append(conn)
        return proc

    def collect(self, kind, count, timeout=40):
        got, deadline = {}, time.monotonic() + timeout
        while len(got) < count:
            left = deadline - time.monotonic()
            ready = mp_connection.wait(self.conns, timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                pytest.fail(f"timed out waiting for {count} {kind!r} messages, got {got}")
            for conn in ready:
                try:
                    msg = msgpack.unpackb(conn.recv_bytes())
                except EOFError:  # that child exited (or was killed by the test)
                    self.conns.remove(conn)
                    continue
                assert msg[0] != "error", msg
                if msg[0] == kind:
                    got[msg[1]] = msg[2:]
        return got

    def cleanup(self):
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        for conn in self.conns:
            conn.close()


@pytest.fixture
def spawn(pool):
    sp = _Spawner(pool)
    try:
        yield sp
    finally:
        sp.cleanup()
    pids = {os.getpid(), *(p.pid for p in sp.procs)}
    deadline = time.monotonic() + 3
    while _our_segments(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _our_segments(pids), "leaked shared-memory segments"


@pytest.fixture
def store():
    s = torch_dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=30))
    yield s


# ---------------------------------------------------------------- tests
@pytest.mark.spawn
@pytest.mark.slow
def test_order_1000_plans_two_local_readers(spawn, store):
    for rank in (1, 2):
        spawn(reader_proc, store.port, KEY, rank, True, 1000)
    writer = PlanWriter(store, [1, 2], [], key=KEY, secret=SECRET)
    try:
        for i in range(1, 1001):
            writer.publish(make_plan(i, 16 + i % 300))
        done = spawn.collect("done", 2)
        assert all(len(v[0]) == 1000 for v in done.values())
        writer.check_readers()
        writer.shutdown("done")
        closed = spawn.collect("closed", 2)
        assert all(v[0] == "done" for v in closed.values())
    finally:
        writer.close()


@pytest.mark.spawn
def test_wraparound_overflow_and_mixed_sizes(spawn, store):
    sizes = [0, 1, 500, 4096 - _HEAD.size, 4097, 20_000, 3 << 20, 7, 5 << 20 | 3, 64]
    plan_sizes = [sizes[i % len(sizes)] for i in range(60)]
    spawn(reader_proc, store.port, KEY, 1, True, len(plan_sizes))
    spawn(reader_proc, store.port, KEY, 2, True, len(plan_sizes), 0.003)  # slow: ring fills
    writer = PlanWriter(store, [1, 2], [], num_slots=3, slot_bytes=4096, key=KEY, secret=SECRET)
    try:
        for i, size in enumerate(plan_sizes, 1):
            writer.publish(make_plan(i, size))
        done = spawn.collect("done", 2)
        expect = [s + _HEAD.size for s in plan_sizes]
        assert done[1][0] == expect and done[2][0] == expect
        writer.shutdown("bye")
        spawn.collect("closed", 2)
    finally:
        writer.close()


@pytest.mark.spawn
def test_local_and_remote_readers_then_shutdown_wakes_quickly(spawn, store):
    spawn(reader_proc, store.port, KEY, 1, True, 200)
    spawn(reader_proc, store.port, KEY, 2, False, 200)
    writer = PlanWriter(store, [1], [2], num_slots=4, slot_bytes=64 << 10, key=KEY, secret=SECRET)
    try:
        for i in range(1, 201):
            writer.publish(make_plan(i, 4 << 20 if i % 50 == 0 else 20_000 if i % 7 == 0 else 300))
        spawn.collect("done", 2)
        time.sleep(1.0)  # both readers are now blocked in receive() and idle
        t0 = time.monotonic()
        writer.shutdown("engine stopped")
        closed = spawn.collect("closed", 2)
        for rank, (reason, t) in closed.items():
            assert reason == "engine stopped"
            assert t - t0 < 0.5, f"rank {rank} woke after {t - t0:.3f} s"
        writer.check_readers()  # readers leaving after shutdown is not an error
    finally:
        writer.close()


@pytest.mark.spawn
def test_reader_timeout(store, spawn):
    writer = PlanWriter(store, [1], [2], key=KEY, secret=SECRET)
    readers = []
    try:
        readers = [PlanReader(store, 1, True, key=KEY, secret=SECRET),
                   PlanReader(store, 2, False, key=KEY, secret=SECRET)]
        writer.publish(make_plan(1, 10))
        for r in readers:
            check_plan(r.receive(timeout=5), 1)
            t0 = time.monotonic()
            with pytest.raises(ChannelTimeout):
                r.receive(timeout=0.3)
            assert 0.25 <= time.monotonic() - t0 < 2.0
        writer.publish(make_plan(2, 10))  # a timeout does not break the channel
        for r in readers:
            check_plan(r.receive(timeout=5), 2)
            r.close()
            r.close()  # idempotent
            with pytest.raises(ChannelClosed):
                r.receive(timeout=1)
    finally:
        for r in readers:
            r.close()
        writer.close()


@pytest.mark.spawn
@pytest.mark.slow
def test_writer_killed_readers_get_closed(spawn, store):
    proc = spawn(writer_proc, store.port, KEY, 3)
    results, ready = {}, {1: threading.Event(), 2: threading.Event()}
    readers = {}

    def run(rank, local):
        try:
            readers[rank] = r = PlanReader(store, rank, local, key=KEY, secret=SECRET)
            for i in range(1, 4):
                check_plan(r.receive(timeout=30), i)
            ready[rank].set()
            r.receive(timeout=30)
            results[rank] = ("plan", None)
        except ChannelClosed as e:
            results[rank] = ("closed", time.monotonic(), str(e))
        except BaseException as e:
            results[rank] = ("error", repr(e))
            ready[rank].set()

    threads = [threading.Thread(target=run, args=(1, True), daemon=True),
               threading.Thread(target=run, args=(2, False), daemon=True)]
    for t in threads:
        t.start()
    try:
        spawn.collect("published", 1)
        assert ready[1].wait(30) and ready[2].wait(30), results
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        for t in threads:
            t.join(15)
        for rank in (1, 2):
            assert results.get(rank, ("missing",))[0] == "closed", results
            assert results[rank][1] - t0 < 10.0, results
        assert results[1][1] - t0 < 2.0  # pid check, not heartbeat
    finally:
        for r in readers.values():
            r.close()
        _forget_tracked_segments(store)


def _forget_tracked_segments(store):
    """The killed writer registered its ring with the resource tracker it shares with pytest
    (spawn children inherit it); the readers already unlinked the ring, so drop that stale
    registration or the tracker warns about a 'leak' when pytest exits."""
    from multiprocessing import resource_tracker

    from nanovllm_tp.distributed.channel_common import open_meta
    name = open_meta(store.get(f"{KEY}/meta"), SECRET)["shm"]
    resource_tracker.unregister("/" + name, "shared_memory")


@pytest.mark.spawn
def test_local_reader_killed_blocked_publish_raises(spawn, store):
    proc = spawn(reader_proc, store.port, KEY, 1, True, 1, 0.0, None, "hang")
    writer = PlanWriter(store, [1], [], num_slots=2, slot_bytes=4096, key=KEY, secret=SECRET)
    try:
        writer.publish(make_plan(1, 10))
        spawn.collect("done", 1)
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerError) as err:
            for i in range(2, 100):  # the ring fills: publish blocks, then must raise
                writer.publish(make_plan(i, 10))
        assert err.value.rank == 1 and time.monotonic() - t0 < 10.0
        with pytest.raises(PeerError):
            writer.check_readers()
    finally:
        writer.close()


@pytest.mark.spawn
@pytest.mark.slow
def test_remote_reader_killed_check_readers_raises(spawn, store):
    proc = spawn(reader_proc, store.port, KEY, 2, False, 1, 0.0, None, "hang")
    writer = PlanWriter(store, [], [2], key=KEY, secret=SECRET, reader_timeout_s=4.0)
    try:
        writer.publish(make_plan(1, 10))
        spawn.collect("done", 1)
        time.sleep(4.5)
        writer.check_readers()  # idle longer than the timeout, but alive: heartbeats flow
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.monotonic()
        while True:
            try:
                writer.check_readers()
            except PeerError as e:
                assert e.rank == 2 and "heartbeat" in e.text
                break
            assert time.monotonic() - t0 < 10.0, "dead remote reader not detected"
            time.sleep(0.1)
    finally:
        writer.close()


@pytest.mark.spawn
def test_report_error_reaches_writer(spawn, store):
    spawn(reader_proc, store.port, KEY, 2, False, 1, 0.0, "CUDA OOM on rank 2 — ünïcode")
    writer = PlanWriter(store, [1], [2], key=KEY, secret=SECRET)
    local = None
    try:
        local = PlanReader(store, 1, True, key=KEY, secret=SECRET)
        writer.publish(make_plan(1, 10))
        check_plan(local.receive(timeout=5), 1)
        spawn.collect("done", 1)
        deadline = time.monotonic() + 5
        while True:
            try:
                writer.check_readers()
            except PeerError as e:
                assert e.rank == 2 and e.text == "CUDA OOM on rank 2 — ünïcode"
                break
            assert time.monotonic() < deadline, "error report never arrived"
            time.sleep(0.05)
        with pytest.raises(PeerError):
            writer.publish(make_plan(2, 10))
    finally:
        if local is not None:
            local.close()
        writer.close()


@pytest.mark.spawn
def test_writer_exit_without_close_unlinks(spawn, store):
    proc = spawn(writer_exit_proc, store.port, KEY)
    (name,) = spawn.collect("created", 1)[0]
    proc.join(30)
    assert proc.exitcode == 0
    assert not os.path.exists(f"/dev/shm/{name}")


STRANGER = os.path.join(REPO, "tests", "tp_scripts", "stranger.py")


@pytest.mark.spawn
@pytest.mark.slow
def test_strangers_neither_steer_nor_read(spawn, store):
    """A local process that is no rank sends random bytes and forged err/bye/hello/hb messages to the back
    channel and subscribes to the plan stream without keys, with made-up keys and with the (leaked) server
    key: the readers get every plan intact, nothing forged is acted on, the stranger reads nothing, and the
    writer counts what it turned away."""
    n = 300
    spawn(reader_proc, store.port, KEY, 1, True, n, 0.01)
    spawn(reader_proc, store.port, KEY, 2, False, n, 0.01)
    writer = PlanWriter(store, [1], [2], key=KEY, secret=SECRET)
    env = dict(os.environ, STRANGER_SERVER_KEY=ChannelKeys(SECRET).server()[0].decode())
    strangers = []
    try:
        writer.publish(make_plan(1, 100))           # both readers have joined
        for mode, endpoint in (("back", writer._back.endpoint), ("sub", writer._pub.endpoint)):
            strangers.append(subprocess.Popen([sys.executable, STRANGER, mode, endpoint, "4"], env=env,
                                              stdout=subprocess.PIPE, text=True))
        for i in range(2, n + 1):
            writer.publish(make_plan(i, 100 + i))
            time.sleep(0.01)
        results = [json.loads(p.communicate(timeout=60)[0]) for p in strangers]
        done = spawn.collect("done", 2)
        assert all(len(v[0]) == n for v in done.values())
        writer.check_readers()                      # the forged "err" and "bye" were not acted on
        assert results[1]["received"] == 0
        dropped = writer.dropped
        assert dropped["unauthenticated_connections"] >= 6, dropped     # 3 raw + plain + made-up keys, twice
        assert dropped["unknown_keys"] >= 2, dropped                      # the leaked-server-key clients
        assert dropped["forged"] == dropped["malformed"] == 0, dropped    # nothing unauthenticated got that far
        writer.shutdown("done")
        spawn.collect("closed", 2)
    finally:
        for p in strangers:
            p.kill()
            p.wait()
        writer.close()


def test_reader_with_another_secret_refuses_the_bootstrap_record(store):
    writer = PlanWriter(store, [], [2], key=KEY, secret=SECRET, join_timeout_s=1.0)
    try:
        with pytest.raises(ChannelError, match="not signed with this engine's secret"):
            PlanReader(store, 2, False, key=KEY, secret=b"another-secret-" * 4)
    finally:
        writer.close()


@pytest.mark.spawn
@pytest.mark.slow
def test_lagging_remote_reader_is_named_and_memory_stays_bounded(spawn, store):
    """Send buffers hold at most ``hwm`` plans per remote reader: one that stops reading loses plans instead of
    growing rank 0's memory, and its next receive says which rank fell behind."""
    spawn(lagging_reader_proc, store.port, KEY, 2, 4.0)
    writer = PlanWriter(store, [], [2], key=KEY, secret=SECRET, hwm=4)
    try:
        writer.publish(make_plan(1, 100))
        spawn.collect("first", 1)
        for i in range(2, 82):                      # 80 MiB: more than the socket buffers hold
            writer.publish(make_plan(i, 1 << 20))
        lagged = spawn.collect("lagged", 1)[2]
        assert "rank 2 fell behind" in lagged[0] and "4 unread plans" in lagged[0], lagged
        assert lagged[1] < 81
    finally:
        writer.close()
