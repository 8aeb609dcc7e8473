"""Process titles, so that an operator can tell the server's processes apart in `ps` and `top`:

    nanovllm_tp::serve            the command that was started (one engine: also its rank 0)
    nanovllm_tp::http             the HTTP process
    nanovllm_tp::dp1::tp0         data-parallel replica 1, its rank 0 (with its own engine loop)
    nanovllm_tp::tp1              rank 1 of a tensor-parallel engine (of replica R: nanovllm_tp::dpR::tp1)

Only the engine's own processes are renamed: `LLM(...)` in a user's program leaves the program's title alone.
With the `setproctitle` package (a dependency) the whole command line shown by `ps -f` becomes the title; the
kernel's short name (`ps -e`, `top`: 15 characters) is set either way, as `nvtp-dp1-tp0`. The title takes the
room of the original command line only, so the process's environment stays readable in /proc.
"""
import ctypes
import ctypes.util
import os
import sys

PREFIX = "nanovllm_tp"
_PR_SET_NAME = 15
REPLICA_ENV = "NANOVLLM_TP_REPLICA"     # a replica's index, handed to the TP workers it spawns (launch protocol)


def rank_title(rank: int, replica: int | str | None = None) -> str:
    """A rank's title: nanovllm_tp::tpK, or nanovllm_tp::dpR::tpK inside data-parallel replica R."""
    return f"{PREFIX}::dp{replica}::tp{rank}" if replica not in (None, "") else f"{PREFIX}::tp{rank}"


def set_title(title: str) -> None:
    """Name this process (best effort: a platform without either mechanism keeps its name)."""
    # the title within the command line's own room: /proc/PID/environ stays the process's environment (without
    # SPT_NOENV setproctitle writes over it to make room for a longer title, and tools that read it see garbage)
    os.environ.setdefault("SPT_NOENV", "1")
    try:
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:
        pass
    if sys.platform.startswith("linux"):
        short = title.replace(f"{PREFIX}::", "nvtp-").replace("::", "-")[:15]
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_NAME, ctypes.c_char_p(short.encode()), 0, 0, 0)
        except OSError:
            pass
