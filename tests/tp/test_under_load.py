"""The tests whose time limits once failed on a loaded machine, run again while both cores are kept busy by
spinning processes (`--busy-cores 2`): they must pass for the suite to be trusted on a loaded CI machine or a
user's laptop. A long form: select it with -m long."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMED = ["tests/tp/test_tp_faults.py::test_signals_end_every_rank",
         "tests/tp/test_tp_faults.py::test_sigkill_rank0_workers_exit_and_clean_shm",
         "tests/serving/test_serve.py::test_a_client_that_disconnects_has_its_request_aborted",
         "tests/serving/test_serve.py::test_beyond_max_waiting_requests_new_ones_get_429",
         "tests/serving/test_serve.py::test_tp2_server_same_outputs_then_a_dead_rank_gives_503_and_sigterm_leaves_nothing",
         "tests/engine/test_soak.py::test_quick_soak_tp2"]


@pytest.mark.long
@pytest.mark.slow
@pytest.mark.spawn
def test_time_limits_hold_with_both_cores_busy():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--busy-cores", "2", *TIMED],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
