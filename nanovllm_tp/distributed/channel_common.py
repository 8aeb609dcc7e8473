"""Shared pieces of the plan channel: exceptions, frame kinds, signed bootstrap record, process liveness,
wait timings. Imports no ZMQ: a same-node engine loads ZMQ only when it opens its back channel."""
from __future__ import annotations

import hashlib
import hmac
import signal
import struct

import msgpack

__all__ = ["ChannelError", "ChannelClosed", "ChannelTimeout", "ChannelLagged", "PeerError", "proc_start_time"]

KIND_DATA, KIND_HEARTBEAT, KIND_SHUTDOWN = 1, 2, 3
_HDR = struct.Struct("<BQ")  # ZMQ data frame header: kind, plan number


class ChannelError(RuntimeError):
    """Base class of plan channel errors."""


class ChannelClosed(ChannelError):
    """The writer shut the channel down (message = reason) or is gone."""


class ChannelTimeout(ChannelError, TimeoutError):
    """A bounded wait expired."""


class ChannelLagged(ChannelError):
    """A remote reader fell so far behind that the writer's bounded send buffer dropped plans."""


class PeerError(ChannelError):
    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank}: {text}")
        self.rank, self.text = rank, text


# Exit codes (Popen.returncode) of a process killed from outside, by an operator or the OOM killer, rather than failing
# by itself (an error, a crash such as SIGSEGV): the engine and the replica supervisor tell the two apart by them.
KILLED_BY = (-signal.SIGKILL, -signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)


def proc_start_time(pid: int | None) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie process; None if gone."""
    if not pid:
        return None
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2:].split()
    return None if fields[0] in (b"Z", b"X", b"x") else int(fields[19])


_CHECK_S = 0.2  # how often liveness is checked while waiting
_MAX_NAP_S = 0.001  # longest sleep of an idle waiter (bounds wake-up latency)


def sign_meta(meta: dict, secret: bytes | None) -> bytes:
    """The bootstrap record as stored: msgpack ``[meta bytes, HMAC-SHA256 under the engine secret]``, so a
    reader acts only on endpoints and ring names its own writer published (the store itself is not trusted)."""
    body = msgpack.packb(meta, use_bin_type=True)
    mac = hmac.new(secret, body, hashlib.sha256).digest() if secret is not None else b""
    return msgpack.packb([body, mac], use_bin_type=True)


def open_meta(raw: bytes, secret: bytes | None) -> dict:
    try:
        body, mac = msgpack.unpackb(raw, raw=False)
        ok = secret is None or hmac.compare_digest(mac, hmac.new(secret, body, hashlib.sha256).digest())
        meta = msgpack.unpackb(body, raw=False) if ok else None
    except Exception:
        ok, meta = False, None
    if not ok or not isinstance(meta, dict):
        raise ChannelError("the plan channel's bootstrap record is not signed with this engine's secret "
                           "(another engine's, or forged)")
    return meta
