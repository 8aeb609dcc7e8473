"""Pipeline parallelism on CPU (gloo point-to-point between stages): PP 2, PP 3 (an uneven split) and TP 2 x PP 2
answer as TP 1 and transformers do, through chunked prefill, prefix-cache hits and preemption, with as many steps in
flight as stages (micro-batches, the default) and with one; an abort of a request whose step is in flight; the layer
split is vLLM's; what does not run across stages yet is refused by name."""
import json
import subprocess

import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.distributed.pp_partition import PARTITION_ENV, layer_counts, stage_layers
from nanovllm_tp.launch.tiny_archs import ARCHS
from tests.helpers import hf_greedy, mixed_prompts
from tests.procs import TORCHRUN, free_port, python_cmd, started
from tests.tp.test_tp import (GREEDY, REPO, SCRIPT, prompts, run_and_read, tokens,  # noqa: F401 (fixtures)
                               tp1_tokens)

SMALL_KV = dict(kvcache_block_size=16, kv_cache_memory=64 << 20)
# A block of the tiny model's 2 KV heads x 32 dims in fp32 costs 4 KiB a layer (K and V): 16 KiB for the 4 layers
# of TP 1, and for the 2 layers of the fullest stage under PP 2 and PP 3 (1, 2, 1), 8 KiB at TP 2 x PP 2 (a head
# each). Sized to 32 blocks, so that the running rows outgrow the pool while later prompts join in mixed steps.
PRESSURE = dict(kvcache_block_size=16, max_model_len=400, max_num_batched_tokens=48)


def test_layer_split_is_vllms(monkeypatch):
    monkeypatch.delenv(PARTITION_ENV, raising=False)
    # the remainder goes to the stages before the last, from the second-to-last backwards
    assert layer_counts(4, 3) == [1, 2, 1]
    assert layer_counts(3, 2) == [2, 1]
    assert layer_counts(5, 3) == [2, 2, 1]
    assert layer_counts(28, 3) == [9, 10, 9]
    assert layer_counts(8, 4) == [2, 2, 2, 2]
    assert [stage_layers(4, s, 3) for s in range(3)] == [range(0, 1), range(1, 3), range(3, 4)]
    with pytest.raises(ValueError, match="exceeds the model's 4 decoder layers"):
        layer_counts(4, 5)
    monkeypatch.setenv(PARTITION_ENV, "3,1")
    assert stage_layers(4, 0, 2) == range(0, 3) and stage_layers(4, 1, 2) == range(3, 4)
    for bad, message in (("2,1", "sums to 3"), ("4", "names 1 stages"), ("4,0", "at least one"), ("a,b", "comma")):
        monkeypatch.setenv(PARTITION_ENV, bad)
        with pytest.raises(ValueError, match=message):
            layer_counts(4, 2)


@pytest.mark.parametrize("knobs, feature", [
    (dict(enable_lora=True), "LoRA"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
    (dict(pooler_config={"pooling_type": "MEAN"}), "embeddings"),
    (dict(batch_invariant=True), "batch invariance"),
    (dict(pipeline_parallel_size=5), "exceeds the model's 4 decoder layers"),
])
def test_refused_by_name_before_any_rank_starts(tiny_model_dir, knobs, feature):
    with pytest.raises(ValueError, match=feature):
        LLM(tiny_model_dir, **{"pipeline_parallel_size": 2, **knobs}, **SMALL_KV)


def test_layer_partition_from_the_environment_is_checked_at_config_time(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, "2,1")
    with pytest.raises(ValueError, match="sums to 3 layers; the model has 4"):
        LLM(tiny_model_dir, pipeline_parallel_size=2, **SMALL_KV)


def run_under_pressure(llm, prompts, in_flight):
    """The prompts twice, in a pool small enough to preempt, then the longest two again (from the prefix cache:
    with several steps in flight the second pass can evict what the first left); `in_flight`: the steps that
    must have been in flight at once."""
    first = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    hits = llm.engine.scheduler.block_manager.num_prefix_hit_tokens
    second = tokens(llm.generate(prompts, GREEDY, use_tqdm=False))
    third = tokens(llm.generate(prompts[-2:], GREEDY, use_tqdm=False))
    sched, stats = llm.engine.scheduler, llm.engine.stats()
    assert sched.block_manager.num_blocks == 32
    assert sched.num_preemptions > 0 and sched.num_mixed_steps > 0
    assert sched.block_manager.num_prefix_hit_tokens > hits
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
    assert stats["max_steps_in_flight"] == in_flight
    assert first == second and third == first[-2:]
    return first


@pytest.mark.spawn
@pytest.mark.slow
@pytest.mark.parametrize("micro_batches", [None, 1])
def test_pp2_matches_tp1_and_transformers(tiny_model_dir, hf_model, prompts, tp1_tokens, micro_batches):
    llm = LLM(tiny_model_dir, pipeline_parallel_size=2, pipeline_micro_batches=micro_batches,
              kv_cache_memory=33 * 16384, **PRESSURE)
    try:
        stats = llm.engine.stats()
        assert stats["pipeline_parallel_size"] == 2 and len(llm.engine.children) == 1
        assert stats["pipeline_micro_batches"] == (micro_batches or 2)
        assert "pipeline stage 0/2 (layers 0..1)" in llm.engine.runner.describe()
        got = run_under_pressure(llm, prompts, in_flight=micro_batches or 2)
        assert got == tp1_tokens
        for p, t in zip(prompts[:3], got[:3]):
            assert t == hf_greedy(hf_model, p, 32)
        with pytest.raises(ValueError, match="embeddings are not implemented with pipeline_parallel_size=2"):
            llm.embed(["hello"])
    finally:
        llm.close()


@pytest.mark.spawn
@pytest.mark.slow
def test_pp3_uneven_split_matches_tp1(tiny_model_dir, prompts, tp1_tokens):
    # 4 layers over 3 stages: 1, 2, 1; the pool is as large as the 2-layer stage can hold
    llm = LLM(tiny_model_dir, pipeline_parallel_size=3, kv_cache_memory=33 * 16384, **PRESSURE)
    try:
        assert "pipeline stage 0/3 (layers 0..0)" in llm.engine.runner.describe()
        assert run_under_pressure(llm, prompts, in_flight=3) == tp1_tokens
    finally:
        llm.close()


@pytest.mark.spawn
@pytest.mark.slow
def test_tp2_pp2_matches_tp1(tiny_model_dir, prompts, tp1_tokens):
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, kv_cache_memory=33 * 8192,
              **PRESSURE)
    try:
        assert len(llm.engine.children) == 3
        assert run_under_pressure(llm, prompts, in_flight=2) == tp1_tokens
    finally:
        llm.close()


@pytest.mark.spawn
@pytest.mark.slow
def test_abort_of_a_request_whose_step_is_in_flight(tiny_model_dir, prompts, tp1_tokens):
    # four requests over two micro-batches; one is aborted while a step of its part is in flight (its end waits for
    # that step's logits), the others run on to the same tokens as TP 1; nothing is left holding blocks
    llm = LLM(tiny_model_dir, pipeline_parallel_size=2, **SMALL_KV)
    try:
        ids = llm.add_requests(prompts[4:], GREEDY)
        sched, outputs = llm.engine.scheduler, {}
        for _ in range(4):      # step() returns with the other part's step still in flight
            for out in llm.step():
                outputs[out.request_id] = out
        assert sched.num_in_flight == 1 and sched.max_in_flight == 2
        victim = next(i for i, rid in enumerate(ids)
                      if any(c.seq in rows for c in llm._requests[rid].completions for rows in sched.rows_in_flight()))
        llm.abort_request(ids[victim])
        while llm.has_unfinished_requests():
            for out in llm.step():
                outputs[out.request_id] = out
        for i, rid in enumerate(ids):
            done = outputs[rid].outputs[0]
            if i == victim:
                assert done.finish_reason == "abort" and len(done.token_ids) < 32
                assert done.token_ids == tp1_tokens[4 + i][:len(done.token_ids)]
            else:
                assert done.finish_reason == "length" and done.token_ids == tp1_tokens[4 + i]
        bm = sched.block_manager
        assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished()
    finally:
        llm.close()


@pytest.mark.spawn
@pytest.mark.slow
def test_structured_outputs_seeded_sampling_and_n_match_tp1(tiny_model_dir, tiny_llm):
    # grammars' masks made while two steps are in flight, seeded sampling, n = 3 siblings in one part
    from tests.engine.test_structured_outputs import PROMPTS as TEXTS, REGEX, SCHEMAS, structured
    params = [structured(seed=11 + i, temperature=1.0, max_tokens=64, **kind) for i, kind in
              enumerate([dict(regex=REGEX), dict(choice=["yes", "no", "maybe later"]), dict(json=SCHEMAS[0])])]
    params += [SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=24, ignore_eos=True),
               SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)]
    texts = [TEXTS[i % len(TEXTS)] for i in range(len(params))]
    want = [[c.token_ids for c in o.outputs] for o in tiny_llm.generate(texts, params, use_tqdm=False)]
    llm = LLM(tiny_model_dir, pipeline_parallel_size=2, **SMALL_KV)
    try:
        got = [[c.token_ids for c in o.outputs] for o in llm.generate(texts, params, use_tqdm=False)]
        assert llm.engine.stats()["max_steps_in_flight"] == 2
    finally:
        llm.close()
    assert got == want and len(got[3]) == 3


@pytest.mark.spawn
@pytest.mark.slow
@pytest.mark.kernel_paths
@pytest.mark.parametrize("tp, pp", [(1, 2), (1, 3), (2, 2)])
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_other_architectures_match_transformers(tmp_path, arch, tp, pp):
    # 3 layers over 2 stages (2, 1) or 3 (1 each), TP 2 inside the stages, a micro-batch per stage, prompts
    # prefilled in chunks of 24 tokens, then again from the prefix cache; Gemma 2: untied embeddings scaled on the
    # first stage, sandwich norms, windows, and the final logit cap on the last; Qwen3-MoE: experts on every stage
    from nanovllm_tp.launch.make_tiny import make_tiny_arch
    hf = make_tiny_arch(tmp_path / arch, arch)
    prompts = mixed_prompts(hf.config.vocab_size, lengths=(3, 17, 40, 70))
    want = [hf_greedy(hf, p, 24) for p in prompts]
    llm = LLM(str(tmp_path / arch), tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=24,
              **SMALL_KV)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    try:
        got = tokens(llm.generate(prompts, params, use_tqdm=False))
        again = tokens(llm.generate(prompts, params, use_tqdm=False))
        stats = llm.engine.stats()
    finally:
        llm.close()
    assert got == want and again == want
    assert stats["prefix_cache_hit_tokens"] > 0 and stats["max_steps_in_flight"] == pp


@pytest.mark.spawn
@pytest.mark.slow
def test_torchrun_pp2_matches_tp1(tiny_model_dir, tmp_path, tp1_tokens):
    out = tmp_path / "tokens.json"
    knobs = json.dumps({**SMALL_KV, "pipeline_parallel_size": 2})
    result = run_and_read(python_cmd(*TORCHRUN, "--standalone", "--nproc-per-node", "2", SCRIPT, tiny_model_dir,
                                     str(out), "1", "--engine-json", knobs), out)
    assert result["tokens"] == tp1_tokens and result["max_steps_in_flight"] == 2
    assert result["local_ranks"] == [1] and result["remote_ranks"] == []


@pytest.mark.spawn
@pytest.mark.slow
def test_two_node_torchrun_a_stage_per_node(tiny_model_dir, tmp_path, tp1_tokens):
    # stage 1 on the second "node": its plans come over ZMQ, its activations and logits over gloo's TCP
    out = tmp_path / "tokens.json"
    port = free_port()
    knobs = json.dumps({**SMALL_KV, "pipeline_parallel_size": 2})
    agents = [python_cmd(*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1",
                         "--master-addr", "127.0.0.1", "--master-port", str(port), SCRIPT, tiny_model_dir, str(out),
                         "1", "--engine-json", knobs) for node in range(2)]
    secret = {"NANOVLLM_TP_SECRET": "two-node-pp-test-secret-0123456789abcdef"}
    with started(agents[1], env=secret, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                 text=True) as node1:
        result = run_and_read(agents[0], out, env=secret)
        log, _ = node1.communicate(timeout=60)
        assert node1.returncode == 0, log[-3000:]
    assert result["remote_ranks"] == [1] and result["local_ranks"] == []
    assert result["tokens"] == tp1_tokens and result["max_steps_in_flight"] == 2
