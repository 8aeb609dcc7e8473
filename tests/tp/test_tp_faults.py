"""A dead or failing rank never hangs the others, and nothing is left behind (processes, /dev/shm)."""
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time

import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.distributed.channel import PeerError
from tests.procs import (TORCHRUN, GONE_WITHIN, LEAK_WARNING, alive, free_port, python_cmd, rank_pid, segments_of,
                         session_pids, started, wait_gone)

pytestmark = pytest.mark.spawn

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(TESTS, "tp_scripts", "generate_tokens.py")
SMALL_KV = dict(kvcache_block_size=16, kv_cache_memory=64 << 20)
LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


def long_prompts(n=64):
    return [[(7 * i + j) % 1500 for j in range(50)] for i in range(n)]


@contextlib.contextmanager
def killed_after(pid: int, seconds: float = 2.0):
    """kill -9 of pid `seconds` into the block, from a thread; yields a list that gets the kill's monotonic time
    (empty if the block ended first). The block's end waits for the thread."""
    killed_at = []

    def kill():
        time.sleep(seconds)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        yield killed_at
    finally:
        killer.join()


@pytest.mark.slow
def test_worker_exception_reaches_caller(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(TESTS, "tp_scripts", "fault_injection") + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("NVTP_TEST_FAIL_RANK", "1")
    monkeypatch.setenv("NVTP_TEST_FAIL_STEP", "3")
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **SMALL_KV)
    children = [c.pid for c in llm.engine.children]
    try:
        with pytest.raises(PeerError) as err:
            llm.generate(long_prompts(4), SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
        assert err.value.rank == 1
        assert "injected fault in the forward of step 3" in str(err.value)
        with pytest.raises(RuntimeError, match="stopped"):
            llm.generate([[1, 2, 3]], use_tqdm=False)
    finally:
        llm.close()
    assert wait_gone(children) is not None
    assert not segments_of(os.getpid())
    assert not llm.engine.has_unfinished()


def test_worker_that_dies_while_starting_fails_the_engine_at_once(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(TESTS, "tp_scripts", "fault_injection") + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("NVTP_TEST_EXIT_AT_START", "1")
    before = set(os.listdir("/dev/shm"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited with code 7 while starting"):
        LLM(tiny_model_dir, tensor_parallel_size=2, **SMALL_KV)
    assert time.monotonic() - t0 < 90, "rank 0 waited for the process group's timeout (120 s)"
    assert set(os.listdir("/dev/shm")) <= before


@pytest.mark.slow
def test_sigkill_worker_mid_generation(tiny_model_dir):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **SMALL_KV)
    worker = llm.engine.children[0].pid
    try:
        with killed_after(worker) as killed_at, pytest.raises(Exception) as err:
            llm.generate(long_prompts(), LONG, use_tqdm=False)
        raised_at = time.monotonic()
    finally:
        llm.close()
    assert killed_at, "generation ended before the worker was killed: make the workload longer"
    assert raised_at - killed_at[0] < 10
    assert "rank 1" in str(err.value)
    assert not alive(worker)
    assert not segments_of(os.getpid())


@pytest.fixture(scope="module")
def tp3_model_dir(tmp_path_factory):
    from nanovllm_tp.launch.make_tiny import make_tiny
    return str(make_tiny(tmp_path_factory.mktemp("tp3") / "tiny-3-heads", num_attention_heads=3,
                         num_key_value_heads=3, intermediate_size=192))


def start_rank0(model_dir, tmp_path, tp=2, launcher=()):
    pids_file = tmp_path / "pids.json"
    cmd = python_cmd(*launcher, SCRIPT, model_dir, str(tmp_path / "out.json"), str(tp), "--engine-json",
                     json.dumps(SMALL_KV), "--pids", str(pids_file), "--long")
    return cmd, pids_file


@contextlib.contextmanager
def logged(cmd, log_path, env=None):
    """started() with stdout and stderr in log_path. Once every process of the session is gone, the log must
    not hold Python's leaked-shared-memory warning: removing segments is the engine's job, not the tracker's.
    (A torchrun worker, and the tracker it starts, run in a session of their own: tests wait for those.)"""
    with open(log_path, "w") as log, started(cmd, env=env, stdout=log, stderr=subprocess.STDOUT) as proc:
        yield proc
        wait_gone(session_pids(proc.pid))
    text = log_path.read_text()
    assert LEAK_WARNING not in text, text[-3000:]


def wait_for_pids(pids_file, proc, timeout=90):
    deadline = time.monotonic() + timeout
    while not pids_file.exists():
        assert proc.poll() is None, "rank 0 exited before its engine was up"
        assert time.monotonic() < deadline, "engine did not come up"
        time.sleep(0.1)
    pids = json.loads(pids_file.read_text())
    time.sleep(1.5)     # let generation get going
    return pids


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 3])
def test_sigkill_rank0_workers_exit_and_clean_shm(tiny_model_dir, tp3_model_dir, tmp_path, tp):
    cmd, pids_file = start_rank0(tiny_model_dir if tp == 2 else tp3_model_dir, tmp_path, tp)
    with logged(cmd, tmp_path / "rank0.log") as proc:
        pids = wait_for_pids(pids_file, proc)
        assert len(pids["workers"]) == tp - 1
        os.kill(pids["rank0"], signal.SIGKILL)
        took = wait_gone(pids["workers"])
        assert took is not None, f"a worker outlived its rank 0 by more than {GONE_WITHIN} s"
    assert session_pids(proc.pid) == []
    assert not segments_of(pids["rank0"])
    text = (tmp_path / "rank0.log").read_text()       # a worker leaves quietly, or says in one line why
    assert "Traceback" not in text, text[-3000:]


@pytest.mark.parametrize("moment", ["start", "joined"])
def test_rank0_killed_while_its_worker_starts_leaves_nothing(tiny_model_dir, tmp_path, monkeypatch, moment):
    """Rank 0 killed -9 while its spawned worker starts: before the worker reaches the store (it exits at once,
    one line), or just after (it would wait for rank 0 in the process group for 120 s): the worker is gone within
    launch.ORPHAN_GRACE_S and leaves neither the store directory nor rank 0's shared memory behind."""
    from nanovllm_tp.distributed.launch import ORPHAN_GRACE_S
    monkeypatch.setenv("PYTHONPATH", os.path.join(TESTS, "tp_scripts", "fault_injection") + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    cmd, _ = start_rank0(tiny_model_dir, tmp_path)
    with logged(cmd, tmp_path / "rank0.log", env={"NVTP_TEST_KILL_RANK0_AT": moment}) as proc:
        assert proc.wait(timeout=120) == -signal.SIGKILL
        t0 = time.monotonic()
        assert wait_gone(session_pids(proc.pid), ORPHAN_GRACE_S + GONE_WITHIN) is not None
        took = time.monotonic() - t0
    assert took < ORPHAN_GRACE_S + 10, took
    assert not segments_of(proc.pid)
    assert not [d for d in os.listdir(tempfile.gettempdir()) if d.startswith(f"nvtp_store_{proc.pid}_")]
    text = (tmp_path / "rank0.log").read_text()
    assert "Traceback" not in text, text[-3000:]
    assert ("died before this rank started" if moment == "start" else "did not leave within") in text, text[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigint-group", "sigterm-rank0"])
def test_signals_end_every_rank(tiny_model_dir, tmp_path, how):
    cmd, pids_file = start_rank0(tiny_model_dir, tmp_path)
    with logged(cmd, tmp_path / "rank0.log") as proc:
        pids = wait_for_pids(pids_file, proc)
        if how == "sigint-group":
            os.killpg(proc.pid, signal.SIGINT)      # what Ctrl-C in a terminal does
        else:
            os.kill(pids["rank0"], signal.SIGTERM)
        assert wait_gone([pids["rank0"], *pids["workers"]]) is not None
        assert proc.returncode != 0
    assert not segments_of(pids["rank0"])


@pytest.mark.slow
def test_torchrun_rank0_death_ends_the_worker(tiny_model_dir, tmp_path):
    torchrun = (*TORCHRUN, "--standalone", "--nproc-per-node", "2")
    cmd, pids_file = start_rank0(tiny_model_dir, tmp_path, launcher=torchrun)
    with logged(cmd, tmp_path / "torchrun.log") as agent:
        pids = wait_for_pids(pids_file, agent)
        worker = rank_pid(agent.pid, 1, SCRIPT)
        assert worker is not None and pids["workers"] == []
        os.kill(pids["rank0"], signal.SIGKILL)
        assert wait_gone([worker]) is not None, f"the worker outlived its rank 0 by more than {GONE_WITHIN} s"
        assert wait_gone([agent.pid, *session_pids(pids["rank0"])]) is not None     # its tracker too
    assert not segments_of(pids["rank0"])


@pytest.mark.slow
def test_remote_rank_death_is_detected_within_seconds(tiny_model_dir, tmp_path):
    # Two one-rank "nodes": rank 1 reads plans over ZMQ and all-reduces over gloo, whose own timeout is 120 s.
    port = free_port()
    agents = []
    for node in range(2):
        torchrun = (*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node",
                    "1", "--master-addr", "127.0.0.1", "--master-port", str(port))
        agents.append(start_rank0(tiny_model_dir, tmp_path, launcher=torchrun))
    secret = {"NANOVLLM_TP_SECRET": "remote-death-test-secret-0123456789abcdef"}   # multi-node needs one
    with logged(agents[1][0], tmp_path / "node1.log", secret) as node1, \
            logged(agents[0][0], tmp_path / "node0.log", secret) as node0:
        pids = wait_for_pids(agents[0][1], node0)
        remote = rank_pid(node1.pid, 1, SCRIPT)
        assert remote is not None
        os.kill(remote, signal.SIGKILL)
        took = wait_gone([pids["rank0"]])
        assert took is not None, f"rank 0 did not notice its remote rank dying within {GONE_WITHIN} s"
        assert wait_gone([node0.pid, node1.pid, *session_pids(pids["rank0"])]) is not None
        assert node0.returncode != 0
    assert not segments_of(pids["rank0"])
