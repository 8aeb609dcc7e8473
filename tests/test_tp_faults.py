"""A dead or failing rank never hangs the others, and nothing is left behind (processes, /dev/shm)."""
import json
import os
import signal
import threading
import time

import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.distributed.channel import PeerError
from tests.procs import alive, python_cmd, segments_of, session_pids, started, wait_gone

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "tp_scripts", "generate_tokens.py")
SMALL_KV = dict(kvcache_block_size=16, kv_cache_memory=64 << 20)
LONG = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)


def long_prompts(n=64):
    return [[(7 * i + j) % 1500 for j in range(50)] for i in range(n)]


def test_worker_exception_reaches_caller(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(HERE, "tp_scripts", "fault_injection") + os.pathsep
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
    assert wait_gone(children, 10) is not None
    assert not segments_of(os.getpid())
    assert not llm.engine.has_unfinished()


def test_sigkill_worker_mid_generation(tiny_model_dir):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **SMALL_KV)
    worker = llm.engine.children[0].pid
    killed_at = []

    def kill_soon():
        time.sleep(2.0)
        killed_at.append(time.monotonic())
        os.kill(worker, signal.SIGKILL)

    killer = threading.Thread(target=kill_soon)
    killer.start()
    try:
        with pytest.raises(Exception) as err:
            llm.generate(long_prompts(), LONG, use_tqdm=False)
        raised_at = time.monotonic()
    finally:
        killer.join()
        llm.close()
    assert killed_at, "generation ended before the worker was killed: make the workload longer"
    assert raised_at - killed_at[0] < 10
    assert "rank 1" in str(err.value)
    assert not alive(worker)
    assert not segments_of(os.getpid())


def start_rank0(model_dir, tmp_path, extra=()):
    pids_file = tmp_path / "pids.json"
    cmd = python_cmd(SCRIPT, model_dir, str(tmp_path / "out.json"), "2", "--engine-json", json.dumps(SMALL_KV),
                     "--pids", str(pids_file), "--long", *extra)
    return cmd, pids_file


def wait_for_pids(pids_file, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not pids_file.exists():
        assert proc.poll() is None, "rank 0 exited before its engine was up"
        assert time.monotonic() < deadline, "engine did not come up"
        time.sleep(0.1)
    pids = json.loads(pids_file.read_text())
    time.sleep(1.5)     # let generation get going
    return pids


def test_sigkill_rank0_workers_exit_and_clean_shm(tiny_model_dir, tmp_path):
    cmd, pids_file = start_rank0(tiny_model_dir, tmp_path)
    with started(cmd) as proc:
        pids = wait_for_pids(pids_file, proc)
        os.kill(pids["rank0"], signal.SIGKILL)
        took = wait_gone(pids["workers"], 10)
        assert took is not None, "a worker outlived its rank 0 by more than 10 s"
        assert session_pids(proc.pid) == []
    assert not segments_of(pids["rank0"])


@pytest.mark.parametrize("how", ["sigint-group", "sigterm-rank0"])
def test_signals_end_every_rank(tiny_model_dir, tmp_path, how):
    cmd, pids_file = start_rank0(tiny_model_dir, tmp_path)
    with started(cmd) as proc:
        pids = wait_for_pids(pids_file, proc)
        if how == "sigint-group":
            os.killpg(proc.pid, signal.SIGINT)      # what Ctrl-C in a terminal does
        else:
            os.kill(pids["rank0"], signal.SIGTERM)
        assert wait_gone([pids["rank0"], *pids["workers"]], 10) is not None
        assert proc.returncode != 0
    assert not segments_of(pids["rank0"])
