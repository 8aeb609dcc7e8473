"""Loaded at start-up by worker processes of the fault tests (via PYTHONPATH): makes one rank's forward
raise at a chosen step, so the test can check that the worker's error text reaches rank 0; or makes a spawned
rank exit before it joins anything, as a worker that cannot import the package would; or makes a spawned rank
kill its rank 0 (kill -9) at a chosen moment of its start: before it joins the store ("start") or right after
("joined", when it goes on to wait for rank 0 in the process group)."""
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
