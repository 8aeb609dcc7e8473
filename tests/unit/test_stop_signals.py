"""serving/shutdown.py's StopSignals in a process of its own: SIGTERM while the main thread is held up past the
timeout. The watcher's emergency is what frees the main thread (as killing a stuck rank frees an all-reduce), and
the main thread then finishes its cleanup while the emergency is still running: the process must still exit with
143, the status of a step cut short, not with the 0 of a clean stop."""
import signal
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading, time
    from nanovllm_tp.serving.shutdown import StopSignals
    freed = threading.Event()
    def emergency():
        freed.set()          # the stuck call returns ...
        time.sleep(1.0)      # ... while the emergency cleanup goes on
    signals = StopSignals(float(sys.argv[1]), emergency)
    print("ready", flush=True)
    if sys.argv[2] == "stuck":
        freed.wait()         # held up until the watcher gives up on it
    else:
        while not signals.received:
            time.sleep(0.01)
    signals.finished()
    sys.exit(0)
""")


def run(timeout: float, mode: str) -> int:
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(timeout), mode], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_main_thread_freed_by_the_emergency_still_exits_143():
    assert run(0.3, "stuck") == 128 + signal.SIGTERM


def test_a_main_thread_that_stops_in_time_exits_0():
    assert run(30, "free") == 0
