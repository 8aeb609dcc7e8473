"""trace_path / --trace: every rank's step spans in one Chrome/Perfetto JSON file, the same tokens as without
it, nothing written when it is off, and a bounded close when a rank died."""
import argparse
import json
import logging
import os
import signal
import subprocess
import threading
import time

import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.utils import trace
from tests.helpers import hf_greedy, mixed_prompts
from tests.procs import TORCHRUN, GONE_WITHIN, alive, python_cmd, segments_of, started, wait_gone

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
SCRIPT = os.path.join(TESTS, "tp_scripts", "generate_tokens.py")
SMALL_KV = dict(kvcache_block_size=16, kv_cache_memory=64 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
ENGINE_SPANS = {"step", "schedule", "encode_plan", "publish", "execute", "prepare", "forward", "lm_head",
                "all_reduce", "gather_logits", "sample", "postprocess", "detokenize"}
WORKER_SPANS = {"receive", "decode_plan", "execute", "prepare", "forward", "lm_head", "all_reduce",
                "gather_logits"}


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def spans(events, pid, name=None):
    return [e for e in events if e["ph"] == "X" and e["pid"] == pid and (name is None or e["name"] == name)]


def within(inner, outer, slack=0.01):
    return outer["ts"] - slack <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack


def each_inside(events, pid, inner, outer):
    outers = spans(events, pid, outer)
    inners = spans(events, pid, inner)
    assert inners, f"no {inner} span on pid {pid}"
    for e in inners:
        assert any(within(e, o) for o in outers), f"{inner} at {e['ts']} is not inside any {outer} on pid {pid}"


def check_layout(data, ranks):
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {r + 1: "rank 0 (scheduler + model)" if r == 0 else f"rank {r}" for r in range(ranks)}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0 and e["tid"] == e["pid"]
    return events


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return mixed_prompts(tiny_llm.config.model_config.vocab_size, lengths=(1, 7, 33, 100))


@pytest.mark.spawn
@pytest.mark.slow
def test_tp2_trace_holds_both_ranks_with_nested_spans(tiny_model_dir, tiny_llm, hf_model, prompts, tmp_path):
    untraced = tokens(tiny_llm.generate(prompts, GREEDY, use_tqdm=False))
    path = tmp_path / "out.json"
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, trace_path=str(path), trace_layers=True, **SMALL_KV)
    try:
        got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        assert not path.exists()                # spans stay in memory until close
        children = llm.engine.children
    finally:
        llm.close()
    assert got == untraced
    for p, t in zip(prompts[:2], got[:2]):
        assert t == hf_greedy(hf_model, p, 16)
    data = json.loads(path.read_text())
    assert data["otherData"] == {"ranks": 2, "missing_ranks": []}
    events = check_layout(data, 2)
    names0, names1 = {e["name"] for e in spans(events, 1)}, {e["name"] for e in spans(events, 2)}
    layers = {f"layer.{i}" for i in range(tiny_llm.config.model_config.num_hidden_layers)}
    assert ENGINE_SPANS | layers <= names0 and WORKER_SPANS | layers <= names1
    assert not names1 & {"step", "schedule", "sample", "publish"}      # rank 0's work only
    for inner, outer in (("schedule", "step"), ("execute", "step"), ("sample", "step"), ("postprocess", "step"),
                         ("detokenize", "step"), ("forward", "execute"), ("layer.0", "forward"),
                         ("all_reduce", "execute"), ("gather_logits", "lm_head")):
        each_inside(events, 1, inner, outer)
    for inner, outer in (("forward", "execute"), ("layer.1", "forward"), ("all_reduce", "execute")):
        each_inside(events, 2, inner, outer)
    # one clock for both processes: each step's forward overlaps on the two ranks (they meet in all-reduces)
    by_step = [{e["args"]["step"]: e for e in spans(events, pid, "execute")} for pid in (1, 2)]
    assert by_step[0].keys() == by_step[1].keys() and len(by_step[0]) >= 16
    for step, a in by_step[0].items():
        b = by_step[1][step]
        assert a["args"] == b["args"]
        assert a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"], f"step {step} does not overlap"
    assert sorted(os.listdir(tmp_path)) == ["out.json"]        # parts merged and removed
    assert all(c.poll() is not None for c in children)
    assert not segments_of(os.getpid())


def test_trace_off_writes_nothing_and_records_nothing(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    llm = LLM(tiny_model_dir, **SMALL_KV)
    try:
        assert trace.span("a") is trace.span("b")      # the shared no-op
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert not trace.enabled and not trace._events
    finally:
        llm.close()
    assert os.listdir(tmp_path) == []


def test_tp1_trace_one_per_process_and_bounded_buffer(tiny_model_dir, tmp_path, monkeypatch, caplog):
    path = tmp_path / "tp1.json"
    monkeypatch.setattr(trace, "MAX_EVENTS", 40)
    llm = LLM(tiny_model_dir, trace_path=str(path), **SMALL_KV)
    try:
        with pytest.raises(ValueError, match="already traces"):
            LLM(tiny_model_dir, trace_path=str(tmp_path / "second.json"), **SMALL_KV)
        llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=False)
    finally:
        with caplog.at_level(logging.INFO, logger="nanovllm_tp"):
            llm.close()
    events = check_layout(json.loads(path.read_text()), 1)
    assert len(spans(events, 1)) == 40
    assert {"step", "schedule", "execute", "forward", "sample"} <= {e["name"] for e in spans(events, 1)}
    assert "dropped" in caplog.text and str(path) in caplog.text
    assert not (tmp_path / "second.json").exists()
    LLM(tiny_model_dir, trace_path=str(tmp_path / "third.json"), **SMALL_KV).close()     # free again
    assert (tmp_path / "third.json").exists()


@pytest.mark.parametrize("kwargs, error", [
    (dict(trace_layers=True), ValueError),
    (dict(trace_path="/nonexistent-dir/out.json"), ValueError),
    (dict(trace_path="."), ValueError),
    (dict(trace_path=7), TypeError),
    (dict(trace_path="x.json", trace_layers="yes"), TypeError),
])
def test_bad_trace_arguments_are_refused(tiny_model_dir, kwargs, error):
    with pytest.raises(error, match="trace"):
        LLM(tiny_model_dir, **kwargs)
    assert not trace.enabled


@pytest.mark.spawn
def test_monotonic_clock_is_shared_by_processes():
    before = time.monotonic_ns()
    child = int(subprocess.check_output(python_cmd("-c", "import time; print(time.monotonic_ns())")))
    after = time.monotonic_ns()
    assert before < child < after


@pytest.mark.spawn
@pytest.mark.slow
def test_dead_rank_leaves_rank0_trace_and_a_log_line(tiny_model_dir, tmp_path, caplog):
    path = tmp_path / "out.json"
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, trace_path=str(path), **SMALL_KV)
    worker = llm.engine.children[0].pid
    killer = threading.Timer(2.0, os.kill, (worker, signal.SIGKILL))
    killer.start()
    try:
        with pytest.raises(Exception, match="rank 1"):
            llm.generate([[(7 * i + j) % 1500 for j in range(50)] for i in range(64)],
                         SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True), use_tqdm=False)
    finally:
        killer.join()
        t0 = time.monotonic()
        with caplog.at_level(logging.INFO, logger="nanovllm_tp"):
            llm.close()
    assert time.monotonic() - t0 < GONE_WITHIN         # it did not wait for the dead rank's part
    data = json.loads(path.read_text())
    assert data["otherData"]["missing_ranks"] == [1]
    events = check_layout(data, 1)
    assert spans(events, 1, "execute") and not spans(events, 2)
    assert "no part from rank(s) [1]" in caplog.text
    assert not alive(worker) and not segments_of(os.getpid())
    assert sorted(os.listdir(tmp_path)) == ["out.json"]


@pytest.mark.spawn
@pytest.mark.slow
def test_torchrun_ranks_merge_into_one_trace(tiny_model_dir, tiny_llm, tmp_path):
    out, path = tmp_path / "tokens.json", tmp_path / "run.json"
    engine = dict(SMALL_KV, trace_path=str(path))
    cmd = python_cmd(*TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT,
                     tiny_model_dir, str(out), "2", "--engine-json", json.dumps(engine))
    with started(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        log, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, log[-3000:]
        assert wait_gone([proc.pid]) is not None
    result = json.loads(out.read_text())
    vocab = tiny_llm.config.model_config.vocab_size
    prompts = mixed_prompts(vocab, lengths=(1, 7, 16, 33, 64, 100, 180, 257))
    want = tokens(tiny_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                    use_tqdm=False))
    assert result["tokens"] == want
    data = json.loads(path.read_text())
    assert data["otherData"]["missing_ranks"] == []
    events = check_layout(data, 2)
    assert {e["args"]["step"] for e in spans(events, 1, "execute")} == \
        {e["args"]["step"] for e in spans(events, 2, "execute")}
    assert sorted(os.listdir(tmp_path)) == ["run.json", "tokens.json"]
    assert not segments_of(result["pid"])


@pytest.mark.spawn
@pytest.mark.slow
def test_launchers_take_trace_flags(tiny_model_dir, tmp_path):
    from nanovllm_tp.bench import throughput as bench, latency as bench_latency, serve as bench_serve, tp as bench_tp
    from nanovllm_tp.launch import generate, serve
    tiny = ["--model", tiny_model_dir, "--num-requests", "3", "--prompt-len", "4", "8", "--output-len", "4", "8",
            "--kv-cache-memory", str(32 << 20), "--quiet"]
    bench.main([*tiny, "--out", str(tmp_path / "bench.json"), "--trace", str(tmp_path / "b.json"),
                "--trace-layers"])
    events = check_layout(json.loads((tmp_path / "b.json").read_text()), 1)
    assert {"step", "forward", "layer.0", "sample"} <= {e["name"] for e in spans(events, 1)}
    bench_tp.main(["--tp-list", "1", *tiny, "--out", str(tmp_path / "tp.json"), "--trace", str(tmp_path / "t.json")])
    check_layout(json.loads((tmp_path / "t.tp1.json").read_text()), 1)
    for parser in (serve.build_parser(), bench_latency.build_parser(), bench_serve.build_parser()):
        args = parser.parse_args(["--trace", "x.json", "--trace-layers"])
        assert args.trace_path == "x.json" and args.trace_layers
    parser = argparse.ArgumentParser()
    generate.add_engine_args(parser)
    assert parser.parse_args([]).trace_path is None
    assert trace.sibling_path("/d/out.json", "offline") == "/d/out.offline.json"     # bench_serve's offline engine
    assert trace.sibling_path("/d/out", "tp2") == "/d/out.tp2.json"
