"""ZMQ pieces of the plan channel: PUB/SUB data link for remote readers and a
PUSH/PULL back channel (all readers -> writer) carrying msgpack control messages.

Data frames are ``[header, payload]`` with ``header = struct "<BQ" (kind, seq)``; the
payload is the raw plan bytes (or the UTF-8 shutdown reason).  Nothing is pickled.

Every connection is authenticated and encrypted with CURVE when ``keys`` is given: rank 0's
sockets are CURVE servers and its ``Gatekeeper`` (the context's ZAP handler) admits only the
client keys of the engine's own ranks, naming each connection by its rank (ZMQ "User-Id"), so a
back-channel message that claims another rank is dropped. Rejected handshakes and dropped messages
are counted. Send buffers are bounded (``PLAN_HWM`` plans); a reader that falls that far behind
misses plans and says so (``ChannelLagged``).
"""
from __future__ import annotations

import collections
import threading
import time

import msgpack
import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from .channel_common import _HDR
from .trust import ChannelKeys

PLAN_HWM = 1024                      # plans queued per remote reader before the writer drops them
_ZERO_COPY_MIN = 64 * 1024
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_WATCHED = _HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_AUTH_GRACE_S = 2.0


def _tcp_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _bind(sock: zmq.Socket, host: str, keys: ChannelKeys | None) -> str:
    if keys is not None:
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = keys.server()
        sock.zap_domain = b"nanovllm_tp"
    if ":" in host:
        sock.setsockopt(zmq.IPV6, 1)
    port = sock.bind_to_random_port(f"tcp://{_tcp_host(host)}")
    return f"tcp://{_tcp_host(host)}:{port}"


def _connect(sock: zmq.Socket, endpoint: str, keys: ChannelKeys | None, rank: int) -> None:
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys.client(rank)
        sock.curve_serverkey = keys.server()[0]
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(endpoint)


class Gatekeeper:
    """Rank 0's authentication: the ZAP handler of its context (CURVE clients whose key is one of its
    ranks' get that rank as User-Id, everyone else is refused) and a monitor on each listening socket
    counting connections that never authenticated (no or wrong keys, random bytes). Driven by one thread
    through ``sockets()`` / ``handle()``; ``counts`` is what was turned away."""

    def __init__(self, ctx: zmq.Context, keys: ChannelKeys | None, ranks):
        self.counts = {"unauthenticated_connections": 0, "failed_handshakes": 0, "unknown_keys": 0,
                       "forged": 0, "malformed": 0}
        self._pending: collections.deque[float] = collections.deque()   # accept times not yet authenticated
        self._monitors: list[tuple[zmq.Socket, zmq.Socket]] = []
        self._zap, self._allowed = None, {}
        if keys is not None:
            self._allowed = {z85.decode(keys.client(r)[0]): str(r).encode() for r in ranks}
            self._zap = ctx.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind(_ZAP_ENDPOINT)

    def watch(self, sock: zmq.Socket) -> None:
        self._monitors.append((sock, sock.get_monitor_socket(_WATCHED)))

    def sockets(self) -> list[zmq.Socket]:
        return ([self._zap] if self._zap is not None else []) + [m for _, m in self._monitors]

    def handle(self, sock: zmq.Socket) -> None:
        if sock is self._zap:
            self._answer_zap()
            return
        event = recv_monitor_message(sock)["event"]
        if event == zmq.EVENT_ACCEPTED:
            self._pending.append(time.monotonic())
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            if self._pending:
                self._pending.popleft()
        else:
            self.counts["failed_handshakes"] += 1

    def tick(self, now: float) -> None:
        """Connections still unauthenticated ``_AUTH_GRACE_S`` after they were accepted count as refused
        (a rank's handshake takes milliseconds; random bytes or a wrong key never complete one)."""
        while self._pending and now - self._pending[0] > _AUTH_GRACE_S:
            self._pending.popleft()
            self.counts["unauthenticated_connections"] += 1

    def _answer_zap(self) -> None:
        # ZAP request (RFC 27): version, request id, domain, address, identity, mechanism, credentials...
        frames = self._zap.recv_multipart()
        request_id = frames[1] if len(frames) > 1 else b""
        user = None
        if len(frames) >= 7 and frames[0] == b"1.0" and frames[5] == b"CURVE":
            user = self._allowed.get(frames[6])
        if user is None:
            self.counts["unknown_keys"] += 1
            self._zap.send_multipart([b"1.0", request_id, b"400", b"not a rank of this engine", b"", b""])
        else:
            self._zap.send_multipart([b"1.0", request_id, b"200", b"OK", user, b""])

    def close(self) -> None:
        for sock, mon in self._monitors:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            mon.close()
        self._monitors = []
        if self._zap is not None:
            self._zap.close()
            self._zap = None


class PubLink:
    """Writer side of the data link. Thread-safe: publish and heartbeats share one socket."""

    def __init__(self, ctx: zmq.Context, host: str, keys: ChannelKeys | None, hwm: int = PLAN_HWM):
        self._sock = ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 1000)  # lets the shutdown frame get out on close
        self.endpoint = _bind(self._sock, host, keys)
        self._lock = threading.Lock()

    @property
    def socket(self) -> zmq.Socket:
        return self._sock

    def send(self, kind: int, seq: int, payload=b"") -> None:
        hdr = _HDR.pack(kind, seq)
        with self._lock:
            if self._sock is None:
                return
            self._sock.send_multipart([hdr, payload], copy=len(payload) < _ZERO_COPY_MIN)

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


class SubLink:
    """Remote reader side of the data link."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: ChannelKeys | None, rank: int, hwm: int = PLAN_HWM):
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        _connect(self._sock, endpoint, keys, rank)

    def recv(self, timeout_s: float):
        """(kind, seq, payload bytes) or None if nothing arrived within ``timeout_s``."""
        if not self._sock.poll(max(0, int(timeout_s * 1000))):
            return None
        frames = self._sock.recv_multipart()
        kind, seq = _HDR.unpack(frames[0])
        return kind, seq, frames[1] if len(frames) > 1 else b""

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class BackServer:
    """Writer side of the back channel (PULL). Used by one thread only."""

    def __init__(self, ctx: zmq.Context, host: str, keys: ChannelKeys | None, counts: dict):
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._sock, host, keys)
        self._secure, self._counts = keys is not None, counts

    @property
    def socket(self) -> zmq.Socket:
        return self._sock

    def drain(self) -> list[dict]:
        """Every queued message from an authenticated rank about itself; the rest are counted and dropped."""
        out = []
        while True:
            try:
                frame = self._sock.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            try:
                msg = msgpack.unpackb(frame.buffer, raw=False)
            except Exception:
                msg = None
            if not isinstance(msg, dict):
                self._counts["malformed"] += 1
            elif self._secure and frame.get("User-Id") != str(msg.get("rank")):
                self._counts["forged"] += 1     # an engine rank speaking for another one
            else:
                out.append(msg)

    def close(self) -> None:
        self._sock.close()


class BackClient:
    """Reader side of the back channel (PUSH). Thread-safe, never blocks."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: ChannelKeys | None, rank: int):
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 500)  # give a final error report a chance on close
        _connect(self._sock, endpoint, keys, rank)
        self._lock = threading.Lock()

    def send(self, msg: dict) -> bool:
        raw = msgpack.packb(msg, use_bin_type=True)
        with self._lock:
            if self._sock is None:
                return False
            try:
                self._sock.send(raw, zmq.NOBLOCK)
                return True
            except zmq.ZMQError:
                return False

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
