"""Loaded at start-up by worker processes of the fault tests (via PYTHONPATH): makes one rank's forward
raise at a chosen step, so the test can check that the worker's error text reaches rank 0; or makes a spawned
rank exit before it joins anything, as a worker that cannot import the package would; or makes a spawned rank
kill its rank 0 (kill -9) at a chosen moment of its start: before it joins the store ("start") or right after
("joined", when it goes on to wait for rank 0 in the process group); or makes a prefill replica die right after a
hand-off, and the replica copying its blocks wait, so that the copy finds that pool gone; or makes every engine
step slower; or makes a rank die in the collective that moves a request's KV."""
import os
import sys

if os.environ.get("NVTP_TEST_EXIT_AT_START") == os.environ.get("RANK") and os.environ.get("NANOVLLM_TP_SPAWNED"):
    print("injected start-up failure", file=sys.stderr, flush=True)
    os._exit(7)

if os.environ.get("NANOVLLM_TP_SPAWNED") and os.environ.get("NVTP_TEST_KILL_RANK0_AT"):
    import signal
    if os.environ["NVTP_TEST_KILL_RANK0_AT"] == "start":
        os.kill(os.getppid(), signal.SIGKILL)
    else:
        from nanovllm_tp.distributed import launch

        _join_spawned = launch.join_spawned

        def join_spawned(info):
            _join_spawned(info)
            os.kill(os.getppid(), signal.SIGKILL)

        launch.join_spawned = join_spawned

if os.environ.get("NVTP_TEST_FAIL_RANK") and os.environ.get("NVTP_TEST_FAIL_RANK") == os.environ.get("RANK"):
    from nanovllm_tp.workers import model_runner

    _execute = model_runner.ModelRunner.execute
    _fail_at = int(os.environ.get("NVTP_TEST_FAIL_STEP", "1"))
    _steps = [0]

    def execute(self, plan):
        _steps[0] += 1
        if _steps[0] == _fail_at:
            raise RuntimeError(f"injected fault in the forward of step {_steps[0]}")
        return _execute(self, plan)

    model_runner.ModelRunner.execute = execute


def _after_import(name: str, patch) -> None:
    """Run patch(module) once module `name` has been imported (at start-up the package is not imported yet)."""
    import importlib.abc
    import importlib.util

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path, target=None):
            if fullname != name:
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(fullname)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                patch(module)
            spec.loader.exec_module = exec_module
            return spec
    sys.meta_path.insert(0, Finder())


if os.environ.get("NVTP_TEST_DIE_AFTER_HANDOFF"):
    # a prefill replica kills itself (kill -9) half a second after its first hand-off by reference, once (the
    # variable names a marker file): its hand-off message is out, and its pool goes with it
    def _die_after_export(kv_transfer):
        export = kv_transfer.export_request

        def export_request(llm, request_id, by_reference=False):
            out = export(llm, request_id, by_reference)
            marker = os.environ["NVTP_TEST_DIE_AFTER_HANDOFF"]
            if by_reference and not os.path.exists(marker):
                import signal
                import threading
                open(marker, "w").close()
                threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
            return out
        kv_transfer.export_request = export_request
    _after_import("nanovllm_tp.engine.kv_transfer", _die_after_export)

if os.environ.get("NVTP_TEST_SLOW_POOL_COPY"):
    # an engine copying blocks from another's pool waits this many seconds first
    def _slow_copy(kv_blocks):
        copy = kv_blocks.copy_from_peer

        def copy_from_peer(*args):
            import time
            time.sleep(float(os.environ["NVTP_TEST_SLOW_POOL_COPY"]))
            return copy(*args)
        kv_blocks.copy_from_peer = copy_from_peer
    _after_import("nanovllm_tp.workers.kv_blocks", _slow_copy)

if os.environ.get("NVTP_TEST_STEP_SLEEP_S"):
    # every engine step of every rank takes this many seconds longer (a tiny model's decode made slow enough to
    # act in the middle of it)
    def _slow_steps(llm_engine):
        step = llm_engine.LLMEngine.step

        def slow_step(self, *args, **kwargs):
            import time
            time.sleep(float(os.environ["NVTP_TEST_STEP_SLEEP_S"]))
            return step(self, *args, **kwargs)
        llm_engine.LLMEngine.step = slow_step
    _after_import("nanovllm_tp.engine.llm_engine", _slow_steps)

if os.environ.get("NVTP_TEST_DIE_IN_KV_MOVE") and os.environ.get("RANK", "0") != "0":
    # "read:MARKER" or "write:MARKER": a rank > 0 kills itself (kill -9) as it joins the first KV_READ (a request
    # leaving with its KV) or KV_WRITE (one arriving) of any engine, once (MARKER: a file made then); rank 0 waits
    # in the collective
    def _die_in_kv_move(kv_blocks):
        kind, marker = os.environ["NVTP_TEST_DIE_IN_KV_MOVE"].split(":", 1)
        name = {"read": "gather_blocks", "write": "scatter_blocks"}[kind]
        move = getattr(kv_blocks, name)

        def dying(*args):
            if not os.path.exists(marker):
                import signal
                open(marker, "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return move(*args)
        setattr(kv_blocks, name, dying)
    _after_import("nanovllm_tp.workers.kv_blocks", _die_in_kv_move)
