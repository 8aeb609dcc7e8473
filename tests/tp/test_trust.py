"""A stranger on the machine can neither steer a TP engine nor read its plans; workers refuse bad plans; a
multi-node engine needs a secret; one multi-rank engine per process, TP=1 engines beside it."""
import json
import logging
import os
import subprocess
import sys
import time

import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.distributed.channel import PeerError
from nanovllm_tp.distributed.trust import ChannelKeys
from tests.helpers import mixed_prompts
from tests.procs import TORCHRUN, free_port, python_cmd, started

pytestmark = pytest.mark.spawn

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)
SMALL_KV = dict(kvcache_block_size=16, kv_cache_memory=64 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return mixed_prompts(tiny_llm.config.model_config.vocab_size, lengths=(1, 9, 33, 100))


@pytest.fixture(scope="module")
def reference(tiny_llm, prompts):
    return tokens(tiny_llm.generate(prompts, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def tp2(tiny_model_dir):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **SMALL_KV)
    yield llm
    llm.close()


def listening_addresses(pid: int) -> set[str]:
    """Local addresses of the TCP sockets this process listens on (from /proc/net/tcp{,6})."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:       # LISTEN
                    out.add(cols[1].rsplit(":", 1)[0])
    return out


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}     # 127.0.0.1, ::1


def test_spawned_engine_listens_on_loopback_only(tp2):
    for pid in [os.getpid()] + [c.pid for c in tp2.engine.children]:
        addresses = listening_addresses(pid)
        assert addresses <= LOOPBACK, (pid, addresses)


@pytest.mark.slow
def test_stranger_cannot_stop_or_steer_the_engine(tp2, prompts, reference, caplog):
    """Random bytes and forged err/bye/hello/hb messages (plain, made-up keys, leaked server key) while the
    engine generates: same tokens, still serving, everything turned away is counted and logged."""
    writer = tp2.engine.writer
    env = dict(os.environ, STRANGER_SERVER_KEY=ChannelKeys(tp2.engine.info.secret).server()[0].decode())
    caplog.set_level(logging.WARNING, logger="nanovllm_tp")
    with started(python_cmd(os.path.join(TESTS, "tp_scripts", "stranger.py"), "back", writer._back.endpoint, "3"),
                 env=env, stdout=subprocess.PIPE, text=True) as stranger:
        during = tokens(tp2.generate(prompts, GREEDY, use_tqdm=False))
        stranger.communicate(timeout=60)
        assert stranger.returncode == 0
    time.sleep(0.5)
    after = tokens(tp2.generate(prompts, GREEDY, use_tqdm=False))
    assert during == after == reference
    dropped = writer.dropped
    assert dropped["unauthenticated_connections"] >= 3 and dropped["unknown_keys"] >= 1, dropped
    assert dropped["forged"] == 0, dropped
    assert any("turned away" in r.getMessage() for r in caplog.records)


def test_second_multi_rank_engine_is_refused_and_tp1_lives_beside(tp2, tiny_model_dir, prompts, reference):
    start = time.monotonic()
    with pytest.raises(ValueError, match="one multi-rank engine at a time"):
        LLM(tiny_model_dir, tensor_parallel_size=2, **SMALL_KV)
    assert time.monotonic() - start < 30
    single = LLM(tiny_model_dir, **SMALL_KV)        # builds without touching the TP=2 group
    try:
        assert tokens(single.generate(prompts, GREEDY, use_tqdm=False)) == reference
        assert tokens(tp2.generate(prompts, GREEDY, use_tqdm=False)) == reference
        assert tokens(single.generate(prompts[:2], GREEDY, use_tqdm=False)) == reference[:2]
    finally:
        single.close()
    assert tokens(tp2.generate(prompts, GREEDY, use_tqdm=False)) == reference


def test_worker_refuses_out_of_range_plan(tp2, prompts):
    """A plan with a block id outside the pool (which used to crash the CPU decode kernel): the worker names
    the step and the field, rank 0 raises PeerError. Runs last in this module: the engine stops."""
    engine, plans = tp2.engine, []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    try:
        tp2.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        engine.scheduler.schedule = schedule
    bad = next(p for p in plans if p is not None).plan
    bad.step_id, bad.block_tables = 424242, bad.block_tables.copy()
    bad.block_tables[0, 0] = 10**6
    engine.writer.publish(bad.encode())
    deadline = time.monotonic() + 20
    with pytest.raises(PeerError) as err:
        while time.monotonic() < deadline:
            engine.writer.check_readers()
            time.sleep(0.05)
    assert err.value.rank == 1
    assert "plan for step 424242: block_tables" in str(err.value)


def _two_node_agents(tiny_model_dir, out):
    port = free_port()
    return [python_cmd(*TORCHRUN, "--nnodes", "2", "--node-rank", str(node),
                       "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                       os.path.join(TESTS, "tp_scripts", "generate_tokens.py"), tiny_model_dir, str(out), "2",
                       "--engine-json", json.dumps(SMALL_KV)) for node in range(2)]


@pytest.mark.slow
def test_two_node_refuses_to_start_without_a_secret(tiny_model_dir, tmp_path):
    env = {"NANOVLLM_TP_SECRET": "", "NANOVLLM_TP_SECRET_FILE": ""}
    a, b = _two_node_agents(tiny_model_dir, tmp_path / "never.json")
    with started(a, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as node0, \
            started(b, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as node1:
        logs = [node0.communicate(timeout=120)[0], node1.communicate(timeout=120)[0]]
    assert node0.returncode != 0 and node1.returncode != 0
    for log in logs:
        assert "needs a shared secret" in log and "secrets.token_hex(32)" in log, log[-3000:]
    assert not (tmp_path / "never.json").exists()


@pytest.mark.slow
def test_two_node_with_a_secret_file(tiny_model_dir, tmp_path, tiny_llm):
    """The secret from a 0600 file on each node; a group- or world-readable one is refused."""
    secret = tmp_path / "secret"
    secret.write_text("f" * 64 + "\n")
    secret.chmod(0o644)
    from nanovllm_tp.distributed.trust import SecretError, read_secret_file
    with pytest.raises(SecretError, match="mode 0600"):
        read_secret_file(str(secret))
    secret.chmod(0o600)
    out = tmp_path / "tokens.json"
    env = {"NANOVLLM_TP_SECRET_FILE": str(secret), "NANOVLLM_TP_SECRET": ""}
    a, b = _two_node_agents(tiny_model_dir, out)
    with started(b, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as node1, \
            started(a, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as node0:
        log0 = node0.communicate(timeout=180)[0]
        log1 = node1.communicate(timeout=60)[0]
    assert node0.returncode == 0 and node1.returncode == 0, (log0[-2000:], log1[-2000:])
    with open(out) as f:
        result = json.load(f)
    assert result["remote_ranks"] == [1]
    script_prompts = mixed_prompts(tiny_llm.config.model_config.vocab_size, lengths=(1, 7, 16, 33, 64, 100, 180, 257))
    want = tiny_llm.generate(script_prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                             use_tqdm=False)
    assert result["tokens"] == tokens(want)


@pytest.mark.slow
def test_tp1_and_shm_path_never_import_zmq(tiny_model_dir):
    code = (
        "import sys; sys.modules['zmq'] = None\n"      # any 'import zmq' now raises ImportError
        "import nanovllm_tp, nanovllm_tp.distributed.channel, nanovllm_tp.distributed.shm_ring\n"
        "import nanovllm_tp.distributed.shm_allreduce, nanovllm_tp.workers.worker, nanovllm_tp.engine.llm_engine\n"
        "from nanovllm_tp import LLM, SamplingParams\n"
        f"llm = LLM({tiny_model_dir!r}, kvcache_block_size=16, kv_cache_memory=16 << 20)\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), "
        "use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 4\n"
        "llm.close()\n"
        "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
