"""`serve org/name` as a vLLM user types it: the hub id resolved through huggingface_hub's cache (built in tmp_path,
offline), the server answering to the id; an id in no cache refused in one line before anything starts. The
server's environment names the cache and HF_HUB_OFFLINE=1: it never reaches for the network."""
import contextlib
import os
import signal
import subprocess

import pytest

from nanovllm_tp import SamplingParams
from tests.procs import free_port, python_cmd, started
from tests.serving.test_data_parallel import replicas, wait_all_ready, wait_replica_back
from tests.serving.test_serve import ENGINE_ARGS, client, stop_server, wait_ready
from tests.unit.test_hub_ids import hub_snapshot, model_files

pytestmark = pytest.mark.spawn
PROMPT = "The quick brown fox"


@pytest.fixture
def hub_env(tmp_path) -> dict[str, str]:
    """A server's environment: a hub cache in tmp_path, offline."""
    cache = str(tmp_path / "hf" / "hub")
    os.makedirs(cache)
    return {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_CACHE": cache, "HF_HUB_OFFLINE": "1"}


@contextlib.contextmanager
def hub_server(model: str, env: dict, *extra: str):
    """(port, process) of `nanovllm-tp serve MODEL` (the positional form) until the block ends."""
    port = free_port()
    cmd = python_cmd("-m", "nanovllm_tp.launch.cli", "serve", model, "--port", str(port), *ENGINE_ARGS, *extra)
    with started(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) as proc:
        try:
            wait_ready(port, proc)
            yield port, proc
        finally:
            stop_server(proc)


def test_serve_a_hub_id_answers_to_it(hub_env, tiny_model_dir, tiny_llm):
    hub_snapshot(hub_env["HF_HUB_CACHE"], "org/tiny", model_files(tiny_model_dir))
    want = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    with hub_server("org/tiny", hub_env) as (port, _):
        c = client(port, key="none")
        assert [m.id for m in c.models.list().data] == ["org/tiny"]
        got = c.completions.create(model="org/tiny", prompt=PROMPT, max_tokens=16, temperature=0)
        assert got.model == "org/tiny" and got.choices[0].text == want.outputs[0].text


@pytest.mark.slow
def test_data_parallel_replicas_load_the_snapshot_the_command_resolved(hub_env, tiny_model_dir):
    """-dp 2: the supervisor resolves the id and hands its replicas the snapshot's path. With the id gone from
    the cache (refs/main removed), a replica killed and started again still loads: it never looks the id up."""
    snapshot = hub_snapshot(hub_env["HF_HUB_CACHE"], "org/tiny", model_files(tiny_model_dir))
    with hub_server("org/tiny", hub_env, "--data-parallel-size", "2") as (port, proc):
        wait_all_ready(port, proc)
        os.remove(os.path.join(snapshot, "..", "..", "refs", "main"))
        first = replicas(proc.pid)
        os.kill(first[0], signal.SIGKILL)
        wait_replica_back(port, proc, 0, first[0])     # it loads the snapshot path, not the id
        got = client(port, key="none").completions.create(model="org/tiny", prompt=PROMPT, max_tokens=4)
        assert got.model == "org/tiny" and got.usage.completion_tokens == 4


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_an_id_in_no_cache_is_refused_in_one_line(command, hub_env):
    cmd = python_cmd("-m", f"nanovllm_tp.launch.{command}", "--model", "org/absent", *ENGINE_ARGS)
    if command == "serve":
        cmd += ["--port", str(free_port())]
    with started(cmd, env=hub_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) as proc:
        _, err = proc.communicate(timeout=120)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert last.startswith(f"{command}: model 'org/absent' ") and last.endswith(
        f"looked in the cache {hub_env['HF_HUB_CACHE']}"), err[-3000:]
