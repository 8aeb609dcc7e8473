"""Shared pieces of the plan channel: exceptions, process liveness, wait timings."""
from __future__ import annotations

__all__ = ["ChannelError", "ChannelClosed", "ChannelTimeout", "PeerError", "proc_start_time"]


class ChannelError(RuntimeError):
    """Base class of plan channel errors."""


class ChannelClosed(ChannelError):
    """The writer shut the channel down (message = reason) or is gone."""


class ChannelTimeout(ChannelError, TimeoutError):
    """A bounded wait expired."""


class PeerError(ChannelError):
    def __init__(self, rank: int, text: str):
        super().__init__(f"rank {rank}: {text}")
        self.rank, self.text = rank, text


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
