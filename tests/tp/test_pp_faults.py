"""Under pipeline parallelism a dead rank of any stage stops the engine within seconds, and nothing is left behind
(processes, /dev/shm)."""
import json
import os
import signal
import time

import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.distributed.channel import PeerError
from tests.procs import GONE_WITHIN, alive, python_cmd, segments_of, session_pids, wait_gone
from tests.tp.test_tp_faults import LONG, SCRIPT, SMALL_KV, TESTS, killed_after, logged, long_prompts, wait_for_pids

pytestmark = [pytest.mark.spawn, pytest.mark.slow]


@pytest.mark.parametrize("pp, tp, victim", [(2, 1, 1), (3, 1, 1), (2, 2, 3)],
                         ids=["pp2-last-stage", "pp3-middle-stage", "tp2xpp2-last-stage-tp1"])
def test_sigkill_a_stage_rank_mid_generation(tiny_model_dir, pp, tp, victim):
    llm = LLM(tiny_model_dir, pipeline_parallel_size=pp, tensor_parallel_size=tp, **SMALL_KV)
    children = [c.pid for c in llm.engine.children]
    worker = children[victim - 1]
    try:
        with killed_after(worker) as killed_at, pytest.raises(Exception) as err:
            llm.generate(long_prompts(), LONG, use_tqdm=False)
        raised_at = time.monotonic()
        with pytest.raises(RuntimeError, match="stopped"):
            llm.generate([[1, 2, 3]], use_tqdm=False)
    finally:
        llm.close()
    assert killed_at, "generation ended before the worker was killed: make the workload longer"
    assert raised_at - killed_at[0] < 10
    assert f"rank {victim}: reader process {worker} died" in str(err.value)     # the cause, not its peers' reports
    assert wait_gone(children) is not None
    assert not alive(worker)
    assert not segments_of(os.getpid())
    assert not llm.engine.has_unfinished()


def test_stage_exception_reaches_caller(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.path.join(TESTS, "tp_scripts", "fault_injection") + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("NVTP_TEST_FAIL_RANK", "2")       # the last of three stages
    monkeypatch.setenv("NVTP_TEST_FAIL_STEP", "3")
    llm = LLM(tiny_model_dir, pipeline_parallel_size=3, **SMALL_KV)
    children = [c.pid for c in llm.engine.children]
    try:
        with pytest.raises(PeerError) as err:
            llm.generate(long_prompts(4), SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
        assert err.value.rank == 2
        assert "injected fault in the forward of step 3" in str(err.value)
    finally:
        llm.close()
    assert wait_gone(children) is not None
    assert not segments_of(os.getpid())


def test_sigkill_rank0_every_stage_exits(tiny_model_dir, tmp_path):
    pids_file = tmp_path / "pids.json"
    cmd = python_cmd(SCRIPT, tiny_model_dir, str(tmp_path / "out.json"), "1", "--engine-json",
                     json.dumps({**SMALL_KV, "pipeline_parallel_size": 2}), "--pids", str(pids_file), "--long")
    with logged(cmd, tmp_path / "rank0.log") as proc:
        pids = wait_for_pids(pids_file, proc)
        assert len(pids["workers"]) == 1
        os.kill(pids["rank0"], signal.SIGKILL)
        assert wait_gone(pids["workers"]) is not None, f"a stage outlived its rank 0 by more than {GONE_WITHIN} s"
    assert session_pids(proc.pid) == []
    assert not segments_of(pids["rank0"])
