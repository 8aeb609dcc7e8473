"""ZMQ pieces of the plan channel: PUB/SUB data link for remote readers and a
PUSH/PULL back channel (all readers -> writer) carrying msgpack control messages.

Data frames are ``[header, payload]`` with ``header = struct "<BQ" (kind, seq)``; the
payload is the raw plan bytes (or the UTF-8 shutdown reason).  Nothing is pickled.
High-water marks are disabled on both ends so PUB never drops a plan for a slow reader.
"""
from __future__ import annotations

import struct
import threading

import msgpack
import zmq

KIND_DATA, KIND_HEARTBEAT, KIND_SHUTDOWN = 1, 2, 3
_HDR = struct.Struct("<BQ")
_ZERO_COPY_MIN = 64 * 1024


def _tcp_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class PubLink:
    """Writer side of the data link. Thread-safe: publish and heartbeats share one socket."""

    def __init__(self, ctx: zmq.Context, host: str):
        self._sock = ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 1000)  # lets the shutdown frame get out on close
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        port = self._sock.bind_to_random_port(f"tcp://{_tcp_host(host)}")
        self.endpoint = f"tcp://{_tcp_host(host)}:{port}"
        self._lock = threading.Lock()

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

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self._sock = ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://["):
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(endpoint)

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

    def __init__(self, ctx: zmq.Context, host: str):
        self._sock = ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        if ":" in host:
            self._sock.setsockopt(zmq.IPV6, 1)
        port = self._sock.bind_to_random_port(f"tcp://{_tcp_host(host)}")
        self.endpoint = f"tcp://{_tcp_host(host)}:{port}"

    def drain(self, timeout_s: float) -> list[dict]:
        """Wait up to ``timeout_s`` for messages, then return every queued one."""
        out = []
        if self._sock.poll(max(0, int(timeout_s * 1000))):
            while True:
                try:
                    raw = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = msgpack.unpackb(raw, raw=False)
                except Exception:  # malformed frame from a stranger: ignore
                    continue
                if isinstance(msg, dict):
                    out.append(msg)
        return out

    def close(self) -> None:
        self._sock.close()


class BackClient:
    """Reader side of the back channel (PUSH). Thread-safe, never blocks."""

    def __init__(self, ctx: zmq.Context, endpoint: str):
        self._sock = ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 500)  # give a final error report a chance on close
        if endpoint.startswith("tcp://["):
            self._sock.setsockopt(zmq.IPV6, 1)
        self._sock.connect(endpoint)
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
