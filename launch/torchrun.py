"""torchrun as torchrun.sh runs it: the same command line and behaviour, except that a SIGTERM or SIGINT sent to
it (which it passes on to every rank) ends with one line and exit code 128 + the signal instead of its
traceback.

    python -m nanovllm_tp.launch.torchrun --standalone --nproc-per-node 2 -m nanovllm_tp.launch.serve --tp 2
"""
import signal
import sys


def main() -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun_main
    try:
        torchrun_main()
    except SignalException as exc:
        print(f"torchrun: stopped by {signal.Signals(exc.sigval).name}; every rank was told to stop",
              file=sys.stderr, flush=True)
        sys.exit(128 + int(exc.sigval))


if __name__ == "__main__":
    main()
