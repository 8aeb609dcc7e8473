"""An engine knob is one EngineConfig field: LLM(...), every command, the spawned workers and the environment
defaults all come from that declaration."""
import argparse
import dataclasses
import json
import os
import pathlib
import re

import pytest
import torch

from nanovllm_tp import LLM, SamplingParams, envs
from nanovllm_tp.bench import throughput as bench, latency as bench_latency, serve as bench_serve
from nanovllm_tp.config import knobs
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.config.engine_config import EngineConfig, add_engine_args, engine_argv, engine_kwargs
from nanovllm_tp.config.knobs import knob, knob_fields
from nanovllm_tp.distributed.launch import config_to_json
from nanovllm_tp.launch import generate, serve
from tests.helpers import hf_greedy, mixed_prompts

COMMANDS = {"generate": generate.build_parser, "bench": bench.build_parser, "bench_latency": bench_latency.build_parser,
            "bench_serve": bench_serve.build_parser, "serve": serve.build_parser}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
REPO = pathlib.Path(__file__).resolve().parents[2]


def other_value(f, tmp_path):
    """A valid value of the knob that is not its default."""
    k, default = f.metadata["knob"], knobs._default(f)
    kind, _ = knobs._base_type(f.type)
    if f.name == "model":
        return str(tmp_path)
    if f.name == "attention_backend":
        return "torch"
    if k.path:
        return str(tmp_path / "out.json")
    if kind is bool:
        return not default
    if kind is dict:
        return {"method": "ngram", "num_speculative_tokens": 2}
    if k.choices:
        return next(c for c in k.choices if c != default)
    if kind is float:
        return 0.5 if default != 0.5 else 0.25
    if kind is str:
        return "v3"
    return (default or 0) + 3


def as_argv(f, value) -> list[str]:
    flag = knobs._flags(f)[0]
    if isinstance(value, bool):
        return [flag if value else "--no-" + flag[2:]]
    return [flag, json.dumps(value) if isinstance(value, dict) else str(value)]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_knob_reaches_every_command(command, tmp_path):
    """Each command's parser takes every EngineConfig knob under the field's own name, hands it to LLM
    unchanged, and engine_argv (a child server's command line) parses back to the same values."""
    parser = COMMANDS[command]()
    defaults = engine_kwargs(parser.parse_args([]))
    assert set(defaults) == {f.name for f in knob_fields(EngineConfig)}
    for f in knob_fields(EngineConfig):
        assert defaults[f.name] == (None if f.name == "model" else knobs._default(f)), f.name
    wanted = {f.name: other_value(f, tmp_path) for f in knob_fields(EngineConfig)}
    argv = [a for f in knob_fields(EngineConfig) for a in as_argv(f, wanted[f.name])]
    args = parser.parse_args(argv)
    assert engine_kwargs(args) == wanted
    assert engine_kwargs(parser.parse_args(engine_argv(args))) == wanted
    assert engine_argv(parser.parse_args([])) == []


def test_gpu_memory_utilization_from_every_command():
    for command, build in COMMANDS.items():
        assert build().parse_args(["--gpu-memory-utilization", "0.6"]).gpu_memory_utilization == 0.6, command


def test_vllm_spellings_and_the_old_flags_parse_to_the_same_knob():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for argv, name, value in [(["-tp", "2"], "tensor_parallel_size", 2), (["--tp", "2"], "tensor_parallel_size", 2),
                              (["--tensor-parallel-size", "2"], "tensor_parallel_size", 2),
                              (["--block-size", "32"], "kvcache_block_size", 32),
                              (["--no-prefix-caching"], "enable_prefix_caching", False),
                              (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
                              (["--trace", "t.json"], "trace_path", "t.json"),
                              (["--no-cpu-kernels"], "cpu_kernels", False),
                              (["--packed-linear", "onednn"], "packed_linear", "onednn")]:
        assert getattr(parser.parse_args(argv), name) == value, argv
    with pytest.raises(SystemExit):
        parser.parse_args(["--packed-linear", "fp32"])         # choices are the declaration's


@dataclasses.dataclass(slots=True)
class WithANewKnob(EngineConfig):
    num_draft_tokens: int = knob(0, help="tokens proposed per step", minimum=0)


def test_a_knob_added_to_the_config_class_alone_is_everywhere(tmp_path):
    """The machinery is generic: a field declared in a subclass is a flag, an LLM keyword, checked by its
    declaration, and travels to spawned workers."""
    parser = argparse.ArgumentParser()
    knobs.add_args(WithANewKnob, parser)
    args = parser.parse_args(["--num-draft-tokens", "4"])
    kwargs = knobs.kwargs_of(WithANewKnob, args)
    assert kwargs["num_draft_tokens"] == 4 and knobs.argv_of(WithANewKnob, args) == ["--num-draft-tokens", "4"]
    config = knobs.config_from_kwargs(WithANewKnob, str(tmp_path), {"num_draft_tokens": 4})
    assert '"num_draft_tokens": 4' in config_to_json(config)
    knobs.check_knobs(config)
    config.num_draft_tokens = -1
    with pytest.raises(ValueError, match="num_draft_tokens must be >= 0, got -1"):
        knobs.check_knobs(config)
    config.num_draft_tokens = True
    with pytest.raises(TypeError, match="num_draft_tokens must be an int, got bool"):
        knobs.check_knobs(config)
    with pytest.raises(TypeError, match="did you mean 'num_draft_tokens'"):
        knobs.config_from_kwargs(WithANewKnob, str(tmp_path), {"num_draft_token": 4})


def test_unknown_engine_arguments_are_refused_with_the_closest_knob(tiny_model_dir):
    with pytest.raises(TypeError, match="unknown engine argument 'max_num_seq'; did you mean 'max_num_seqs'"):
        LLM(tiny_model_dir, max_num_seq=4)
    with pytest.raises(TypeError, match="unknown engine argument 'model_config'"):
        LLM(tiny_model_dir, model_config=None)      # set by validation, not a knob
    with pytest.raises(TypeError, match="unknown engine argument 'zzz'; the engine's knobs: model, "):
        LLM(tiny_model_dir, zzz=1)
    with pytest.raises(TypeError, match="'data_parallel_size' is not an engine argument: .* --data-parallel-size D"):
        LLM(tiny_model_dir, data_parallel_size=2)      # vLLM's name, a server feature here
    with pytest.raises(ValueError, match="packed_linear must be one of 'auto', 'c\\+onednn', 'c', 'bf16', 'onednn', 'off', got 'x'"):
        LLM(tiny_model_dir, packed_linear="x")
    with pytest.raises(TypeError, match="cpu_kernels must be a bool, got str"):
        LLM(tiny_model_dir, cpu_kernels="no")


def test_environment_variables_are_defaults_that_an_argument_overrides(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("NANOVLLM_TP_CPU_KERNELS", "0")
    monkeypatch.setenv("NANOVLLM_TP_PACKED_LINEAR", "0")
    monkeypatch.setenv("NANOVLLM_TP_SHM_ALLREDUCE", "0")
    config = EngineConfig(tiny_model_dir)
    assert (config.cpu_kernels, config.packed_linear, config.shm_allreduce) == (False, "off", False)
    config = EngineConfig(tiny_model_dir, cpu_kernels=True, packed_linear="auto", shm_allreduce=True)
    assert (config.cpu_kernels, config.packed_linear, config.shm_allreduce) == (True, "auto", True)
    monkeypatch.setenv("NANOVLLM_TP_PACKED_LINEAR", "all")         # the old spellings of the variable
    assert EngineConfig(tiny_model_dir).packed_linear == "auto"
    for name in ("NANOVLLM_TP_CPU_KERNELS", "NANOVLLM_TP_PACKED_LINEAR", "NANOVLLM_TP_SHM_ALLREDUCE"):
        monkeypatch.delenv(name)
    config = EngineConfig(tiny_model_dir)
    assert (config.cpu_kernels, config.packed_linear, config.shm_allreduce) == (True, "auto", True)


def test_every_variable_the_package_names_is_declared_in_envs():
    """No NANOVLLM_TP_* variable is read without a line in envs.py (the spawn hand-over of distributed/launch.py
    and the replica index a data-parallel server hands its ranks are the launch protocol, not settings)."""
    protocol = {"NANOVLLM_TP_SPAWNED", "NANOVLLM_TP_STORE_DIR", "NANOVLLM_TP_SPAWN_SECRET", "NANOVLLM_TP_SPAWN_OWNER",
                "NANOVLLM_TP_REPLICA"}
    found = {}
    for folder in ("nanovllm_tp", "scheduler", "workers", "launch", "bench"):
        for path in (REPO / folder).rglob("*.py"):
            for name in re.findall(r"[\"'](NANOVLLM_TP_[A-Z_]+)[\"']", path.read_text()):
                found.setdefault(name, path.name)
    undeclared = {n: p for n, p in found.items() if n not in envs.VARIABLES and n not in protocol}
    assert not undeclared
    assert {"NANOVLLM_TP_CPU_KERNELS", "NANOVLLM_TP_SECRET", "NANOVLLM_TP_API_KEY"} <= set(found)
    with pytest.raises(KeyError):
        envs.get("NANOVLLM_TP_NOT_DECLARED")
    for source in ("layers", "distributed", "serving"):     # read through envs only
        for path in (REPO / "nanovllm_tp" / source).rglob("*.py"):
            assert not re.search(r"os\.environ(\.get)?[\[(][\"']NANOVLLM_TP_", path.read_text()), path


def test_cpu_kernels_is_per_engine(tiny_model_dir, hf_model):
    """Two engines of one process, one on the C kernels and one on torch ops, stepped in turn: each keeps its
    own path, and both give transformers' greedy tokens."""
    plain = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=16 << 20, cpu_kernels=False)
    # the C linear kernel forced: which kernel the measured table picks for the tiny shapes depends on the load
    fast = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=16 << 20, packed_linear="c")
    try:
        assert "attention torch," in plain.engine.runner.describe() and "linear c" not in plain.engine.runner.describe()
        kernels = cpu_kernels.load()
        c_linear = kernels is not None and torch.float32 in kernels.linear_dtypes     # AVX-512 F: the fp32 kernel
        assert "attention cpu," in fast.engine.runner.describe()
        assert ("linear c" in fast.engine.runner.describe()) == c_linear
        prompts = mixed_prompts(plain.config.model_config.vocab_size, lengths=(3, 17, 40))
        for i, p in enumerate(prompts):
            plain.add_request(p, GREEDY, request_id=f"p{i}")
            fast.add_request(p, GREEDY, request_id=f"f{i}")
        done = {}
        while plain.has_unfinished_requests() or fast.has_unfinished_requests():
            for llm in (plain, fast):
                done.update({o.request_id: o.outputs[0].token_ids for o in llm.step() if o.finished})
        for i, p in enumerate(prompts):
            want = hf_greedy(hf_model, p, GREEDY.max_tokens)
            assert done[f"p{i}"] == want and done[f"f{i}"] == want
    finally:
        plain.close()
        fast.close()


@pytest.mark.spawn
@pytest.mark.slow
def test_shm_allreduce_off_keeps_gloo_and_the_tokens(tiny_model_dir, hf_model):
    from nanovllm_tp.distributed import shm_allreduce
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, kvcache_block_size=16, kv_cache_memory=16 << 20,
              shm_allreduce=False)
    try:
        assert shm_allreduce.installed() is None
        prompts = mixed_prompts(llm.config.model_config.vocab_size, lengths=(5, 33))
        out = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    finally:
        llm.close()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"nvtp_{os.getpid()}_")]
