"""Tensor parallelism on CPU (gloo): TP=2 equals TP=1 and transformers, through every launch mode."""
import json
import os
import subprocess
import sys

import pytest

from nanovllm_tp import LLM, SamplingParams
from tests.helpers import hf_greedy, mixed_prompts
from tests.procs import TORCHRUN, free_port, python_cmd, segments_of, started

SCRIPT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tp_scripts", "generate_tokens.py")
SMALL_KV = dict(kvcache_block_size=16, kv_cache_memory=64 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return mixed_prompts(tiny_llm.config.model_config.vocab_size, lengths=(1, 7, 16, 33, 64, 100, 180, 257))


@pytest.fixture(scope="module")
def tp1_tokens(tiny_llm, prompts):
    return tokens(tiny_llm.generate(prompts, GREEDY, use_tqdm=False))


def test_vocab_does_not_divide_by_tp(tiny_llm):
    assert tiny_llm.config.model_config.vocab_size % 2 == 1     # the padded last shard is exercised


@pytest.mark.spawn
@pytest.mark.slow
def test_tp2_spawn_matches_tp1_and_transformers(tiny_model_dir, hf_model, prompts, tp1_tokens):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **SMALL_KV)
    try:
        assert len(llm.engine.children) == 1 and llm.engine.local_ranks == [1]
        got = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        assert got == tp1_tokens
        for p, t in zip(prompts[:3], got[:3]):
            assert t == hf_greedy(hf_model, p, 32)
        children = llm.engine.children
    finally:
        llm.close()
    assert all(c.poll() is not None for c in children)
    assert not segments_of(os.getpid())


@pytest.mark.spawn
@pytest.mark.slow
def test_tp2_chunked_prefix_preemption_matches_tp1(tiny_model_dir, prompts, tp1_tokens):
    # each rank holds one of the two kv heads: a block is 16 KiB per rank, so this is a 32-block pool (small
    # enough that the running rows outgrow it while later prompts are admitted in mixed steps)
    knobs = dict(kvcache_block_size=16, max_model_len=400, kv_cache_memory=33 * 16384, max_num_batched_tokens=48)
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, **knobs)
    try:
        first = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
        hits = llm.engine.scheduler.block_manager.num_prefix_hit_tokens
        second = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))     # the same prompts again: cache hits
        sched = llm.engine.scheduler
        assert sched.block_manager.num_blocks == 32
        assert sched.num_preemptions > 0 and sched.num_mixed_steps > 0
        assert sched.block_manager.num_prefix_hit_tokens > hits
        assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    finally:
        llm.close()
    assert first == second == tp1_tokens


@pytest.mark.spawn
@pytest.mark.slow
def test_kv_heads_replicated_when_tp_exceeds_them(tmp_path, prompts):
    from nanovllm_tp.launch.make_tiny import make_tiny
    model = str(make_tiny(tmp_path / "mqa", num_key_value_heads=1))
    llm1 = LLM(model, **SMALL_KV)
    want = tokens(llm1.generate(prompts[:4], GREEDY, use_tqdm=False))
    llm2 = LLM(model, tensor_parallel_size=2, **SMALL_KV)
    try:
        assert tokens(llm2.generate(prompts[:4], GREEDY, use_tqdm=False)) == want
    finally:
        llm2.close()


def test_heads_must_divide(tiny_model_dir):
    with pytest.raises(ValueError, match="num_attention_heads"):
        LLM(tiny_model_dir, tensor_parallel_size=3, **SMALL_KV)


def run_and_read(cmd, out, timeout=180, env=None):
    with started(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        log, _ = proc.communicate(timeout=timeout)
        assert proc.returncode == 0, log[-3000:]
    with open(out) as f:
        return json.load(f)


@pytest.mark.spawn
@pytest.mark.slow
def test_torchrun_matches_tp1(tiny_model_dir, tmp_path, tp1_tokens):
    out = tmp_path / "tokens.json"
    result = run_and_read(python_cmd(*TORCHRUN, "--standalone", "--nproc-per-node", "2",
                                     SCRIPT, tiny_model_dir, str(out), "2", "--engine-json", json.dumps(SMALL_KV)),
                          out)
    assert result["tokens"] == tp1_tokens
    assert result["local_ranks"] == [1] and result["remote_ranks"] == []
    assert not segments_of(result["pid"])


@pytest.mark.spawn
@pytest.mark.slow
def test_two_node_torchrun_crosses_zmq(tiny_model_dir, tmp_path, tp1_tokens):
    out = tmp_path / "tokens.json"
    port = free_port()
    agents = []
    for node in range(2):
        cmd = python_cmd(*TORCHRUN, "--nnodes", "2", "--node-rank", str(node),
                         "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                         SCRIPT, tiny_model_dir, str(out), "2", "--engine-json", json.dumps(SMALL_KV))
        agents.append(cmd)
    secret = {"NANOVLLM_TP_SECRET": "two-node-test-secret-0123456789abcdef"}   # multi-node needs one
    with started(agents[1], env=secret, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 text=True) as node1:
        result = run_and_read(agents[0], out, env=secret)
        log, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, log[-3000:]
    assert result["remote_ranks"] == [1] and result["local_ranks"] == []
    assert result["tokens"] == tp1_tokens


@pytest.mark.spawn
@pytest.mark.slow
def test_spawn_script_and_torchrun_wrapper(tiny_model_dir, tmp_path, tp1_tokens):
    out = tmp_path / "spawned.json"
    result = run_and_read(python_cmd(SCRIPT, tiny_model_dir, str(out), "2", "--engine-json", json.dumps(SMALL_KV)),
                          out)
    assert result["tokens"] == tp1_tokens
    out2 = tmp_path / "wrapped.json"
    # the running interpreter, not whichever python3 is first on PATH (outside an activated venv, not this one)
    result = run_and_read(["bash", os.path.join(REPO, "torchrun.sh"), "2", SCRIPT, tiny_model_dir, str(out2), "2",
                           "--engine-json", json.dumps(SMALL_KV)], out2, env={"PYTHON": sys.executable})
    assert result["tokens"] == tp1_tokens
