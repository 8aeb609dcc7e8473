"""torchrun as torchrun.sh runs it: the same command line and behaviour, except that
- a SIGTERM or SIGINT sent to it (which it passes on to every rank) ends with one line and exit code 128 + the signal
  instead of its traceback;
- the log directory torchrun makes when given none (an empty tree under /tmp per run, which torchrun never
  removes) is made here and removed on exit. A `--log-dir` of your own is left alone.

    python -m nanovllm_tp.launch.torchrun --standalone --nproc-per-node 2 -m nanovllm_tp.launch.serve --tp 2
"""
import os
import shutil
import signal
import sys
import tempfile


def main() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main
    own = any(a.split("=")[0] in ("--log-dir", "--log_dir") for a in sys.argv[1:])   # anywhere: then hands off
    log_dir = None if own else tempfile.mkdtemp(prefix=f"nanovllm_tp-torchrun-{os.getpid()}-")
    if log_dir is not None:
        sys.argv[1:1] = ["--log-dir", log_dir]
    try:
        torchrun_main()
    except SignalException as exc:
        print(f"torchrun: stopped by {signal.Signals(exc.sigval).name}; every rank was told to stop",
              file=sys.stderr, flush=True)
        sys.exit(128 + int(exc.sigval))
    finally:
        if log_dir is not None:
            shutil.rmtree(log_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
