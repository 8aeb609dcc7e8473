"""launch/gpu_check: its CPU dry run end to end (every part in its own process, the table at the end), its
token comparison on outputs that differ, one exactness row against transformers, and LLM.stats()."""
import contextlib
import json
import os
import pathlib
import signal
import subprocess
import tempfile
import sys
import threading
import time
import uuid

import pytest
import torch

from nanovllm_tp.bench.hf import hf_greedy
from nanovllm_tp.launch import gpu_check
from tests.procs import segments_of, started

REPO = pathlib.Path(__file__).resolve().parents[2]
TPUT_ROWS = ["engine tok/s, graphs", "engine tok/s, eager", "graphs vs eager tokens (float32)", "graph speed-up",
             "transformers CB tok/s"]


def processes_with(marker: str, command: str = "") -> list[int]:
    """Live processes whose environment carries the marker (everything a run started inherits it) and whose
    command line contains `command`."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f, open(f"/proc/{entry}/cmdline", "rb") as g:
                if marker.encode() in f.read() and command.encode() in g.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


@contextlib.contextmanager
def marked_run(tmp_path, *args, **kwargs):
    """The check in its dry run, every process it starts marked and watched; none may outlive it, nor any shared
    memory segment of theirs (segment names carry the pid of the engine's rank 0)."""
    value, seen, done = uuid.uuid4().hex, set(), threading.Event()

    def watch():
        while not done.wait(0.1):
            seen.update(processes_with(value))

    watcher = threading.Thread(target=watch, daemon=True)
    cmd = [sys.executable, "-m", "nanovllm_tp.launch.gpu_check", "--dry-run", "--out", str(tmp_path), *args]
    try:
        with started(cmd, env={"OMP_NUM_THREADS": "1", "NVTP_GPU_CHECK_TEST": value}, cwd=REPO, **kwargs) as proc:
            watcher.start()
            yield proc, value
        done.set()
        watcher.join()
        assert not processes_with(value), "a process of the run outlived it"
        assert len(seen) > 1 and not {s for pid in seen for s in segments_of(pid)}
    finally:
        done.set()
        for pid in processes_with(value):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.spawn
@pytest.mark.slow
def test_dry_run_checks_every_row_and_writes_the_table(tmp_path):
    with marked_run(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as (proc, _):
        out, err = proc.communicate(timeout=300)
    log = tmp_path / "gpu_check.log"
    assert proc.returncode == 0, out[-4000:] + err[-4000:] + (log.read_text()[-6000:] if log.exists() else "")
    table = (tmp_path / "gpu_check.md").read_text().rstrip()
    assert out.rstrip().endswith(table), "the table is printed last"
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {(r["part"], r["check"]): r for r in data["rows"]}
    assert data["dry_run"] and set(data["parts"]) == set(gpu_check.PARTS)
    assert all(p["exit_code"] == 0 for p in data["parts"].values()), data["parts"]
    assert rows[("pytest", "tests/gpu")]["status"] == ("PASS" if torch.cuda.is_available() else "SKIP")
    for check, dtype, _, _ in gpu_check.VARIANTS:
        assert rows[("exact", check)]["status"] == ("SKIP" if dtype == "float16" else "PASS"), rows[("exact", check)]
        assert f"| exact | {check} |" in table
    assert rows[("tp2", gpu_check.VARIANTS[0][0])]["status"] == "PASS"
    # the rows that must exercise a path say so from LLM.stats()
    assert " 0 preemptions" not in rows[("exact", "fp32, preemption")]["result"]
    assert " 0 prefix-cache hit" not in rows[("exact", "fp32, prefix-cache hits")]["result"]
    for check in TPUT_ROWS:
        assert rows[("tput", check)]["status"] in ("PASS", "INFO") and f"| tput | {check} |" in table
    assert float(rows[("tput", "engine tok/s, graphs")]["result"].split()[0].replace(",", "")) > 0
    assert (tmp_path / "gpu_check.log").stat().st_size > 0


@pytest.mark.spawn
@pytest.mark.slow
def test_stopping_the_check_stops_its_parts(tmp_path):
    """SIGTERM to the check while its TP=2 part runs an engine: it exits, and takes the part and its worker along,
    and the workers' rendezvous directory too."""
    stores = set(pathlib.Path(tempfile.gettempdir()).glob("nvtp_store_*"))
    with marked_run(tmp_path, "--skip", "pytest,exact,tput", stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL) as (proc, marker):
        deadline = time.monotonic() + 120
        while not processes_with(marker, "nanovllm_tp.workers") and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_with(marker, "nanovllm_tp.workers"), "the TP=2 part never started its worker"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 143
    assert set(pathlib.Path(tempfile.gettempdir()).glob("nvtp_store_*")) <= stores


def test_compare_tokens_reports_every_difference():
    want = [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert gpu_check.compare_tokens([list(w) for w in want], want) == ("PASS", "2/2 identical")
    status, summary = gpu_check.compare_tokens([[1, 2, 3, 4], [5, 6, 9, 8]], want)
    assert status == "FAIL" and summary == "1/2 identical, first differences {1: 2}"
    assert gpu_check.compare_tokens([[1, 2, 3], [5, 6, 7, 8]], want) == ("FAIL", "1/2 identical, first "
                                                                          "differences {0: 3}")
    assert gpu_check.compare_tokens([[1, 2, 3, 4]], want)[0] == "FAIL"
    # half precision: 1 prompt in 8 may flip early; a flip after the first `within` tokens is tolerated
    want8 = [[i, i + 1, i + 2, i + 3] for i in range(8)]
    got = [list(w) for w in want8]
    got[3][0] = 99
    got[5][2] = 99
    assert gpu_check.compare_tokens(got, want8, within=1)[0] == "PASS"
    assert gpu_check.compare_tokens(got, want8, within=3)[0] == "FAIL"
    assert gpu_check.compare_tokens(got, want8)[0] == "FAIL"


def test_exactness_row_fails_when_the_reference_differs(tiny_model_dir, hf_model):
    """One real row: the engine against transformers passes; the same row against a reference with one token
    or one logprob changed fails."""
    prompts, lens = [[5, 17, 300, 42, 7] * 4, [1000, 3, 99]], [6, 9]
    want = [hf_greedy(hf_model, p, n) for p, n in zip(prompts, lens)]
    with torch.no_grad():
        first = [hf_model(torch.tensor([p])).logits[0, -1].float().log_softmax(-1) for p in prompts]
    variant = ("fp32, prefix-cache hits", "float32", {"kv_cache_memory": 16 << 20}, "hits")

    def row(tokens, logprobs):
        return gpu_check.check_variant("exact", tiny_model_dir, "cpu", (prompts, lens, tokens, logprobs), variant, 1)

    good = row(want, first)
    assert good.status == "PASS", good
    bad_token = [list(want[0]), want[1][:4] + [(want[1][4] + 1) % 2003] + want[1][5:]]
    bad = row(bad_token, first)
    assert bad.status == "FAIL" and bad.result.startswith("1/2 identical, first differences {1: 4}"), bad
    shifted = [first[0], first[1] + 0.5 * first[1].std()]      # half a std off: over the 1e-2 fp32 tolerance
    assert row(want, shifted).status == "FAIL"


def test_stats_reports_the_engine_and_its_counters(tiny_model_dir):
    from nanovllm_tp import LLM, SamplingParams
    llm = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=16 << 20, max_model_len=256)
    try:
        prompt = list(range(1, 40))
        for _ in range(2):
            llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
        stats = llm.stats()
        assert (stats["num_running"], stats["num_waiting"]) == (0, 0)

        def now():
            s = llm.stats()
            return s["num_running"], s["num_waiting"], s["kv_cache_usage"]

        rid = llm.add_request(list(range(50, 90)), SamplingParams(max_tokens=8))
        load = [now()]
        llm.step()
        load.append(now())
        llm.abort_request(rid)
        load.append(now())
    finally:
        llm.close()
    assert stats["device"] == "cpu" and stats["dtype"] == "float32" and stats["tensor_parallel_size"] == 1
    assert stats["attention_backend"] == "cpu" and stats["kv_block_size"] == 16 and stats["num_kv_blocks"] > 0
    assert stats["cuda_graph_batch_sizes"] is None and stats["num_preemptions"] == 0
    assert stats["prefix_cache_hit_tokens"] == 32 and stats["num_steps"] >= 4     # two full blocks of 39 tokens
    blocks = stats["num_kv_blocks"]
    assert load[0][:2] == (0, 1) and load[1][:2] == (1, 0) and load[2][:2] == (0, 0)
    assert load[1][2] == pytest.approx(3 / blocks) and load[2][2] <= load[1][2]    # 41 tokens: 3 blocks of 16
    with pytest.raises(RuntimeError, match="closed"):
        llm.stats()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit, match="--dry-run"):
        gpu_check.main(["--out", "/nonexistent/never-written"])
    with pytest.raises(SystemExit, match="unknown parts"):
        gpu_check.main(["--dry-run", "--skip", "tput,bogus"])
