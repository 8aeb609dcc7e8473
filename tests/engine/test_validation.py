"""Bad input is refused with a clear ValueError/TypeError before anything runs, and the engine is unharmed.

Uses the real engine on the tiny random checkpoint (fixtures from conftest.py). Every refused `generate`
call is checked to have run no step, to leave no unfinished work and no held KV block, and to leave the
engine giving the same greedy tokens as before.
"""
import json
import math
import re
import shutil

import pytest

from nanovllm_tp import LLM, SamplingParams

PROMPTS = ["Hello, world!", [5, 6, 7, 8]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SMALL = dict(kvcache_block_size=16, kv_cache_memory=64 << 20)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.fixture(scope="module")
def baseline(tiny_llm):
    out = token_ids(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert all(len(t) >= 1 for t in out)
    return out


def assert_refused(llm, baseline, exc, pattern, *args, **kwargs):
    """generate(*args) raises exc matching pattern, runs nothing, and the engine still works the same."""
    sched = llm.engine.scheduler
    bm = sched.block_manager
    step_before = sched.step_id
    with pytest.raises(exc, match=pattern):
        llm.generate(*args, use_tqdm=False, **kwargs)
    assert sched.step_id == step_before, "a step ran for a refused request"
    assert not llm.engine.has_unfinished() and not sched.waiting and not sched.running
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    assert token_ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline


# ---------------------------------------------------------------- prompts

@pytest.mark.parametrize("prompts,exc,pattern", [
    ("", ValueError, r"prompt 0 is empty"),                 # a string that tokenizes to nothing
    ([], ValueError, r"prompts is empty"),
    ([[]], ValueError, r"prompt 0 is empty"),
    (["fine", ""], ValueError, r"prompt 1 is empty"),
    ([5] * 4096, ValueError, r"4096 tokens.*max_model_len=4096"),      # at most max_model_len - 1 fit
    ("hello " * 5000, ValueError, r"prompt 0 has \d+ tokens.*max_model_len=4096"),
    ([-1], ValueError, r"token id -1 is outside the vocabulary \[0, 2003\)"),
    ([[1, 2], [3, 2003]], ValueError, r"prompt 1: token id 2003 is outside the vocabulary"),
    (None, TypeError, r"prompts must be .*NoneType"),
    (3.5, TypeError, r"prompts must be .*float"),
    (b"abc", TypeError, r"prompts must be .*bytes"),
    (["hello", 5], TypeError, r"prompt 1 must be a string or a list of token ids, got int"),
    ([5, "hello"], TypeError, r"prompt 0 must be a string or a list of token ids, got int"),
    ([[1, "a"]], TypeError, r"prompt 0: token ids must be ints, got str"),
    ([[1, 2.0]], TypeError, r"token ids must be ints, got float"),
    ([True, 5], TypeError, r"token ids must be ints, got bool"),
], ids=lambda v: repr(v)[:24] if not isinstance(v, type) else v.__name__)
def test_bad_prompt_is_refused(tiny_llm, baseline, prompts, exc, pattern):
    assert_refused(tiny_llm, baseline, exc, pattern, prompts, GREEDY)


def test_vocab_bound_comes_from_the_model(tiny_llm):
    assert tiny_llm.config.model_config.vocab_size == 2003     # the pattern above hard-codes it
    last = tiny_llm.generate([[2002, 2002]], GREEDY, use_tqdm=False)   # the last id is in range
    assert len(last[0].outputs[0].token_ids) >= 1


def test_batch_with_one_bad_prompt_is_refused_whole(tiny_llm, baseline):
    # The bad prompt is the last one: the good ones in front must not have been queued or run.
    assert_refused(tiny_llm, baseline, ValueError, r"prompt 2: token id 99999",
                   ["Hello, world!", [5, 6, 7], [1, 99999]], GREEDY)
    assert_refused(tiny_llm, baseline, ValueError, r"prompt 1 has 5000 tokens",
                   [[5, 6, 7], [9] * 5000, "fine"], GREEDY)


@pytest.mark.parametrize("prompts,ids,pattern", [
    (["Hello", [1, 99999]], None, r"prompt 1: token id 99999"),
    (["Hello", "world"], ["a", "a"], r"request_id must be a new string, got 'a'"),
    (["Hello"], ["a", "b"], r"request_ids must be a list of 1 ids"),
])
def test_add_requests_queues_all_or_none(tiny_llm, baseline, prompts, ids, pattern):
    """The server's batches: step()-driven requests sharing one SamplingParams, checked whole before any is
    queued."""
    with pytest.raises(ValueError, match=pattern):
        tiny_llm.add_requests(prompts, GREEDY, request_ids=ids)
    assert not tiny_llm.has_unfinished_requests()
    assert token_ids(tiny_llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == baseline


# ---------------------------------------------------------------- sampling parameters

def edited(**changes):
    """A SamplingParams made valid, then edited into an invalid state (generate() must re-validate)."""
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    for name, value in changes.items():
        setattr(sp, name, value)
    return sp


BAD_PARAMS = [
    (dict(temperature=-0.5), ValueError, r"temperature .*got -0\.5"),
    (dict(temperature=math.nan), ValueError, r"temperature .*got nan"),
    (dict(temperature=math.inf), ValueError, r"temperature .*got inf"),
    (dict(temperature=-math.inf), ValueError, r"temperature"),
    (dict(temperature="0.5"), TypeError, r"temperature must be a number, got str"),
    (dict(temperature=None), TypeError, r"temperature must be a number, got NoneType"),
    (dict(max_tokens=0), ValueError, r"max_tokens must be >= 1, got 0"),
    (dict(max_tokens=-3), ValueError, r"max_tokens must be >= 1, got -3"),
    (dict(max_tokens=2.0), TypeError, r"max_tokens must be an int or None, got float"),
    (dict(max_tokens="8"), TypeError, r"max_tokens must be an int or None, got str"),
    (dict(max_tokens=True), TypeError, r"max_tokens must be an int or None, got bool"),
    (dict(ignore_eos="yes"), TypeError, r"ignore_eos must be a bool"),
    (dict(seed=-1), ValueError, r"seed must be >= 0"),
    (dict(stream_interval=0), ValueError, r"stream_interval must be >= 1, got 0"),
    (dict(seed=2**63), ValueError, r"seed must be <= "),
    (dict(seed=1.5), TypeError, r"seed must be an int"),
    (dict(temperature=1e39), ValueError, r"temperature must be a finite float32 number"),
    (dict(n=0), ValueError, r"n must be >= 1, got 0"),
    (dict(n=2.0), TypeError, r"n must be an int"),
    (dict(top_p=0.0), ValueError, r"top_p must be > 0"),
    (dict(top_p=1.5), ValueError, r"top_p must be <= 1"),
    (dict(top_k=-2), ValueError, r"top_k must be >= -1, got -2"),
    (dict(top_k=1.0), TypeError, r"top_k must be an int"),
    (dict(min_p=-0.1), ValueError, r"min_p must be >= 0"),
    (dict(min_p=1.1), ValueError, r"min_p must be <= 1"),
    (dict(presence_penalty=2.5), ValueError, r"presence_penalty must be <= 2"),
    (dict(frequency_penalty=-2.5), ValueError, r"frequency_penalty must be >= -2"),
    (dict(repetition_penalty=0.0), ValueError, r"repetition_penalty must be > 0"),
    (dict(repetition_penalty=math.nan), ValueError, r"repetition_penalty must be a finite"),
    (dict(stop=""), ValueError, r"stop cannot contain an empty string"),
    (dict(stop=["a", 3]), TypeError, r"stop must be a string or a list of strings"),
    (dict(stop=7), TypeError, r"stop must be a string or a list of strings, got int"),
    (dict(stop_token_ids=[1, -1]), ValueError, r"each of stop_token_ids must be >= 0"),
    (dict(stop_token_ids=5), TypeError, r"stop_token_ids must be a list of ints"),
    (dict(include_stop_str_in_output=1), TypeError, r"include_stop_str_in_output must be a bool"),
    (dict(min_tokens=-1), ValueError, r"min_tokens must be >= 0"),
    (dict(max_tokens=2**64), ValueError, r"max_tokens must be <= 9223372036854775807"),   # the per-row arrays
    (dict(min_tokens=2**64), ValueError, r"min_tokens must be <= 9223372036854775807"),
    (dict(max_tokens=4, min_tokens=5), ValueError, r"min_tokens must be <= max_tokens=4, got 5"),
    (dict(logprobs=-1), ValueError, r"logprobs must be >= 0"),
    (dict(prompt_logprobs=1.0), TypeError, r"prompt_logprobs must be an int or None"),
    (dict(skip_special_tokens=None), TypeError, r"skip_special_tokens must be a bool"),
    (dict(output_kind=7), ValueError, r"output_kind must be a RequestOutputKind"),
    (dict(stream_interval=0), ValueError, r"stream_interval must be >= 1, got 0"),
    (dict(stream_interval="4"), TypeError, r"stream_interval must be an int or None, got str"),
]


@pytest.mark.parametrize("kwargs,exc,pattern", BAD_PARAMS, ids=lambda v: repr(v)[:30])
def test_sampling_params_constructor_refuses(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,exc,pattern", BAD_PARAMS, ids=lambda v: repr(v)[:30])
def test_generate_revalidates_edited_sampling_params(tiny_llm, baseline, kwargs, exc, pattern):
    assert_refused(tiny_llm, baseline, exc, pattern, PROMPTS, edited(**kwargs))


@pytest.mark.parametrize("params,exc,pattern", [
    ("greedy", TypeError, r"sampling_params must be a SamplingParams or a list of them, got str"),
    ({"temperature": 0}, TypeError, r"sampling_params must be .*got dict"),
    (0.0, TypeError, r"sampling_params must be .*got float"),
    ([GREEDY], ValueError, r"got 1 sampling_params for 2 prompts"),
    ([GREEDY] * 3, ValueError, r"got 3 sampling_params for 2 prompts"),
    ([GREEDY, "x"], TypeError, r"sampling_params entries must be SamplingParams, got str"),
    ([GREEDY, None], TypeError, r"entries must be SamplingParams, got NoneType"),
    ([GREEDY, edited(max_tokens=0)], ValueError, r"max_tokens must be >= 1"),   # one bad entry: whole batch
], ids=lambda v: repr(v)[:24] if not isinstance(v, type) else v.__name__)
def test_bad_sampling_params_are_refused(tiny_llm, baseline, params, exc, pattern):
    assert_refused(tiny_llm, baseline, exc, pattern, PROMPTS, params)


def test_tiny_positive_temperature_is_refused_or_greedy(tiny_llm, baseline):
    try:
        out = tiny_llm.generate(PROMPTS, SamplingParams(temperature=1e-38, max_tokens=6), use_tqdm=False)
    except ValueError as e:
        assert "temperature" in str(e)
        return
    assert token_ids(out) == baseline


# ---------------------------------------------------------------- engine construction

@pytest.mark.parametrize("knobs,exc,pattern", [
    (dict(tensor_parallel_size=0), ValueError, r"tensor_parallel_size must be >= 1, got 0"),
    (dict(tensor_parallel_size=3), ValueError, r"tensor_parallel_size=3 must divide num_attention_heads=4"),
    (dict(max_num_seqs=0), ValueError, r"max_num_seqs must be >= 1, got 0"),
    (dict(max_num_seqs=2.5), TypeError, r"max_num_seqs must be an int, got float"),
    (dict(max_num_batched_tokens=-1), ValueError, r"max_num_batched_tokens must be >= 1, got -1"),
    (dict(gpu_memory_utilization=1.5), ValueError, r"gpu_memory_utilization must be <= 1\.0, got 1\.5"),
    (dict(gpu_memory_utilization=0), ValueError, r"gpu_memory_utilization"),
    (dict(dtype="int8"), ValueError, r"dtype must be .*got 'int8'"),
    (dict(device="tpu"), ValueError, r"device must be one of 'auto', 'cpu', 'cuda', got 'tpu'"),
    (dict(kvcache_block_size=0), ValueError, r"kvcache_block_size must be >= 1, got 0"),
    (dict(max_model_len=8192), ValueError, r"max_model_len=8192 exceeds .*max_position_embeddings=4096"),
    (dict(max_model_len=1), ValueError, r"max_model_len must be at least 2"),
    (dict(kv_cache_memory=0), ValueError, r"kv_cache_memory must be >= 1"),
    (dict(seed=-1), ValueError, r"seed must be >= 0"),
    (dict(stream_interval=0), ValueError, r"stream_interval must be >= 1, got 0"),
    (dict(enable_prefix_caching="yes"), TypeError, r"enable_prefix_caching must be a bool"),
    (dict(attention_backend="sdpa"), ValueError,
     r"attention_backend must be 'auto' or one of 'cpu', 'flash', 'torch', 'torch-cuda', got 'sdpa'"),
    (dict(attention_backend=None), TypeError, r"attention_backend must be a string, got NoneType"),
    (dict(attention_backend="flash", device="cpu"), ValueError, r"attention_backend=flash runs on cuda, not cpu"),
], ids=lambda v: repr(v)[:32] if not isinstance(v, type) else v.__name__)
def test_invalid_engine_knobs(tiny_model_dir, knobs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        LLM(tiny_model_dir, **{**SMALL, **knobs})


def test_kv_cache_too_small_for_one_max_len_sequence(tiny_model_dir):
    # One block of 16 tokens is 2 (K,V) * 4 layers * 16 * 2 kv heads * 32 dims * 4 bytes = 32 KiB, so 1 MiB
    # holds 31 usable blocks (one is the null block); a 4096-token sequence needs 256.
    with pytest.raises(ValueError, match=r"holds 31 blocks.*needs 256: raise kv_cache_memory"):
        LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=1 << 20)


def test_missing_model_directory(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError, match=re.escape(repr(str(missing))) + " does not exist"):
        LLM(str(missing), **SMALL)


def test_model_must_be_a_path():
    with pytest.raises(TypeError, match="model must be a path"):
        LLM(None, **SMALL)


def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json"):
        LLM(str(tmp_path), **SMALL)


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    model_dir = shutil.copytree(tiny_model_dir, tmp_path / "gpt2")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture \['GPT2LMHeadModel'\].*Qwen3ForCausalLM"):
        LLM(str(model_dir), **SMALL)


# ---------------------------------------------------------------- max_model_len edge on the real engine

def test_prompt_at_the_length_limit(tiny_model_dir):
    llm = LLM(tiny_model_dir, max_model_len=32, **SMALL)
    many = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    out = llm.generate([[7] * 31, [7] * 29], many, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [1, 3]     # 31 + 1 = 29 + 3 = max_model_len
    assert [o.outputs[0].finish_reason for o in out] == ["length", "length"]
    with pytest.raises(ValueError, match=r"32 tokens; with max_model_len=32 at most 31 fit"):
        llm.generate([[7] * 32], many, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    again = llm.generate([[7] * 31, [7] * 29], many, use_tqdm=False)
    assert token_ids(again) == token_ids(out)


# ---------------------------------------------------------------- a bad request while others are in flight

@pytest.mark.parametrize("prompt,params,exc,pattern", [
    ([], GREEDY, ValueError, r"prompt 0 is empty"),
    ([7, 2003], GREEDY, ValueError, r"token id 2003 is outside the vocabulary"),
    ([5] * 4096, GREEDY, ValueError, r"4096 tokens.*max_model_len=4096"),
    ([7, 8], "greedy", TypeError, r"sampling_params must be a SamplingParams"),
    ([7, 8], edited(temperature=-1.0), ValueError, r"temperature"),
], ids=["empty", "vocab", "too-long", "params-type", "edited-params"])
def test_bad_add_request_mid_flight_leaves_the_others_unchanged(tiny_llm, baseline, prompt, params, exc, pattern):
    llm, sched = tiny_llm, tiny_llm.engine.scheduler
    ids = [llm.add_request(p, GREEDY) for p in PROMPTS]
    done = {o.request_id: o for _ in range(2) for o in llm.step() if o.finished}     # prefill, then a decode step
    state = [(s.seq_id, list(s.token_ids), list(s.block_table)) for s in sched.running]
    assert len(state) == 2 and not sched.waiting and not done
    step_before, free_before = sched.step_id, sched.block_manager.num_free_blocks
    with pytest.raises(exc, match=pattern):
        llm.add_request(prompt, params)
    assert [(s.seq_id, list(s.token_ids), list(s.block_table)) for s in sched.running] == state
    assert not sched.waiting and sched.step_id == step_before
    assert sched.block_manager.num_free_blocks == free_before
    while llm.has_unfinished_requests():
        done.update((o.request_id, o) for o in llm.step())
    assert sorted(done) == sorted(ids)
    assert [done[i].outputs[0].token_ids for i in ids] == baseline
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks
