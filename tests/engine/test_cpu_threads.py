"""A CPU engine's thread count where nothing fixes it (config/cpu_threads.py): the cores other processes leave,
read from /proc/stat with real busy processes beside the engine; a kernel table that other processes spoiled is
measured again only on quiet cores (layers/kernel_choice.py)."""
import json
import os
import time
import types

import pytest
import torch
import torch.nn.functional as F

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.config import cpu_threads
from nanovllm_tp.layers import kernel_choice
from nanovllm_tp.layers.kernel_choice import BUCKETS, Candidate, choose
from tests.helpers import kernel_cache
from tests.procs import busy_machine

CPUS = len(os.sched_getaffinity(0))
pytestmark = [pytest.mark.spawn, pytest.mark.skipif(CPUS < 2 or not os.path.exists("/proc/stat"),
                                                    reason="needs two cores and /proc/stat")]


@pytest.fixture
def own_threads(monkeypatch, busy_cores):
    """This process's thread count and governor restored after the test; the tests need quiet cores besides
    the processes they start."""
    if busy_cores:
        pytest.skip("--busy-cores: these tests start their own busy processes")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("NANOVLLM_TP_THREADS_AUTO", raising=False)
    before, governor = torch.get_num_threads(), cpu_threads._governor
    cpu_threads._governor = None
    yield
    cpu_threads._governor = governor
    torch.set_num_threads(before)


def quiet(within: float = 20.0) -> float:
    """Wait until other processes use under a quarter of a core (what earlier tests started has ended)."""
    deadline = time.monotonic() + within
    while (load := cpu_threads.others_busy(0.25)) >= 0.25 and time.monotonic() < deadline:
        pass
    return load


def step_until(llm: LLM, done, within: float) -> bool:
    """Keep the engine stepping (requests of 64 tokens, one after another) until done() or `within` seconds."""
    deadline, params = time.monotonic() + within, SamplingParams(max_tokens=64, ignore_eos=True)
    while time.monotonic() < deadline:
        if done():
            return True
        llm.generate(["the quick brown fox"] * 4, params, use_tqdm=False)
    return done()


def test_busy_cores_take_the_threads_and_quiet_ones_give_them_back(tiny_model_dir, own_threads):
    assert quiet() < 0.25
    llm = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=16 << 20)
    try:
        threads = lambda: llm.stats()["cpu_threads"]
        assert threads() == {"threads": CPUS, "auto": True, "ceiling": CPUS, "other_cores": threads()["other_cores"],
                             "changes": 0}
        with busy_machine(CPUS):
            assert step_until(llm, lambda: threads()["threads"] == 1, within=20), threads()
            # what the spinners got beside the engine's thread (not all they asked for)
            assert threads()["other_cores"] > CPUS / 2 - 0.25 and threads()["changes"] == 1
        quiet()
        assert step_until(llm, lambda: threads()["threads"] == CPUS, within=20), threads()
        assert threads()["changes"] == 2
    finally:
        llm.close()


def test_an_engine_started_on_busy_cores_starts_with_one_thread(tiny_model_dir, own_threads):
    with busy_machine(CPUS):
        time.sleep(0.3)
        llm = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=16 << 20)
        try:
            assert llm.stats()["cpu_threads"]["threads"] == 1 and torch.get_num_threads() == 1
        finally:
            llm.close()


def test_a_count_the_user_gives_is_kept(tiny_model_dir, own_threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", str(CPUS))
    torch.set_num_threads(CPUS)
    with busy_machine(CPUS):
        llm = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=16 << 20)
        try:
            llm.generate(["hello"] * 2, SamplingParams(max_tokens=8), use_tqdm=False)
            assert llm.stats()["cpu_threads"] == {"threads": CPUS, "auto": False}
        finally:
            llm.close()
    # serve's own choice (OMP_NUM_THREADS set for its ranks, NANOVLLM_TP_THREADS_AUTO beside it) is a ceiling
    monkeypatch.setenv("NANOVLLM_TP_THREADS_AUTO", "1")
    with busy_machine(CPUS):
        governor = cpu_threads.govern(1)
    assert governor is not None and governor.ceiling == CPUS and torch.get_num_threads() == 1


def test_serve_marks_only_its_own_choice_as_a_ceiling(monkeypatch):
    from nanovllm_tp.launch.engine_server import engine_threads
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("NANOVLLM_TP_THREADS_AUTO", raising=False)
    before = torch.get_num_threads()
    try:
        args = types.SimpleNamespace(device="cpu", threads=None, tensor_parallel_size=1, pipeline_parallel_size=1)
        engine_threads(args)
        assert args.threads == CPUS and os.environ["NANOVLLM_TP_THREADS_AUTO"] == "1"
        args = types.SimpleNamespace(device="cpu", threads=1, tensor_parallel_size=1, pipeline_parallel_size=1)
        engine_threads(args)            # --threads given: fixed
        assert "NANOVLLM_TP_THREADS_AUTO" not in os.environ and os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


def test_a_table_other_processes_spoiled_is_measured_again_only_on_quiet_cores(tmp_path, monkeypatch, busy_cores):
    if busy_cores:
        pytest.skip("--busy-cores: the quiet half cannot run")
    cache = kernel_cache(tmp_path, monkeypatch)
    # two real kernels for fp32 weights on any CPU: torch's F.linear on the weight and on a contiguous copy
    for name in ("f_linear_a", "f_linear_b"):
        monkeypatch.setitem(kernel_choice.CANDIDATES, name, Candidate(
            name, lambda w: isinstance(w, torch.Tensor) and w.dtype == torch.float32, lambda w: w.clone(),
            lambda x, w, b: F.linear(x, w, b)))
    monkeypatch.setattr(kernel_choice, "CANDIDATES", {k: v for k, v in kernel_choice.CANDIDATES.items()
                                                      if k.startswith("f_linear")})
    weights = [torch.randn(48, 64)]
    path = kernel_choice.cache_path(torch.float32)
    spoiled = {"winners": ["f_linear_a"] * len(BUCKETS), "us": {"f_linear_a": [1.0] * len(BUCKETS),
                                                                 "f_linear_b": [1.0] * len(BUCKETS)},
               "disturbed": True}
    kernel_choice.write_table(path, {"48x64": spoiled})
    with busy_machine(CPUS):
        time.sleep(0.3)
        table, = kernel_choice.table_of_chosen(choose(weights).values())
    assert table.cached and table.disturbed                   # busy: the spoiled entry serves, nothing timed
    assert json.loads(path.read_text())["shapes"]["48x64"] == spoiled
    assert quiet() < 0.25
    table, = kernel_choice.table_of_chosen(choose(weights).values())
    assert not table.cached and set(table.micros) == {"f_linear_a", "f_linear_b"}     # quiet: timed again
    entry = json.loads(path.read_text())["shapes"]["48x64"]
    assert entry["us"] != spoiled["us"] and entry.get("disturbed", False) == table.disturbed
    assert list(cache.glob("kernel-choice-float32-*.json")) == [path]
