"""The attention backend interface: every backend module registers itself, the choice per device, dtype and
block size, the config field reaching every rank, and engines on explicitly chosen backends against
transformers. CUDA-only choices are checked here through their host-side policy (tests/unit/test_gpu_path_cpu.py
holds the block-size rules; tests/gpu what runs on a device)."""
import importlib
import inspect
import pkgutil

import pytest
import torch

import nanovllm_tp.layers.attention as attention_pkg
from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.distributed.channel_common import PeerError
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.attention.base import BACKENDS, AttentionBackend
from nanovllm_tp.layers.attention.cpu_paged import CpuBackend
from nanovllm_tp.layers.attention.flash import FlashBackend
from nanovllm_tp.layers.attention.registry import backend_names, select_backend
from nanovllm_tp.layers.attention.torch_sdpa import TorchBackend
from nanovllm_tp.utils.context import Context
from tests.helpers import hf_greedy, mixed_prompts

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
SMALL = dict(device="cpu", kvcache_block_size=16, kv_cache_memory=32 << 20, max_num_seqs=4)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_each_backend_module_registers_its_backend():
    """One module per backend, each registering it: the registry's names are exactly what the modules hold."""
    defined = {}
    for info in pkgutil.iter_modules(attention_pkg.__path__):
        module = importlib.import_module(f"nanovllm_tp.layers.attention.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, AttentionBackend) and cls.__module__ == module.__name__ and "name" in vars(cls):
                defined.setdefault(info.name, []).append(cls)
    assert all(len(classes) == 1 for classes in defined.values()), defined
    assert backend_names() == sorted(cls.name for (cls,) in defined.values()) == ["cpu", "flash", "torch",
                                                                                  "torch-cuda"]
    for (cls,) in defined.values():
        assert BACKENDS[cls.name] is cls and cls.devices and set(cls.devices) <= {"cpu", "cuda"}


def test_cpu_auto_choice_follows_the_c_kernels():
    assert cpu_kernels.load() is not None, "this machine builds the kernels (cc is installed)"
    for dtype in (torch.float32, torch.bfloat16):
        assert type(select_backend(CPU, dtype, None)) is CpuBackend
        assert type(select_backend(CPU, dtype, 16, "torch")) is TorchBackend
    assert type(select_backend(CPU, torch.float64, None)) is TorchBackend      # no kernel for that dtype
    with pytest.raises(ValueError, match="attention_backend=cpu, but the C kernels take float32 and bfloat16"):
        select_backend(CPU, torch.float64, None, "cpu")
    with cpu_kernels.switched(False):          # an engine built with cpu_kernels=False
        assert type(select_backend(CPU, torch.float32, None)) is TorchBackend
        with pytest.raises(ValueError, match="attention_backend=cpu, but the C kernels are not available here"):
            select_backend(CPU, torch.float32, None, "cpu")


def test_backends_refuse_the_wrong_device():
    """Checked on the device type alone, so CUDA's side of it runs here too."""
    with pytest.raises(ValueError, match=r"attention_backend=cpu runs on cpu, not cuda \(there: auto, flash, "
                                         r"torch, torch-cuda\)"):
        select_backend(CUDA, torch.bfloat16, None, "cpu")
    for name in ("flash", "torch-cuda"):
        with pytest.raises(ValueError, match=rf"attention_backend={name} runs on cuda, not cpu \(there: auto, "
                                             r"cpu, torch\)"):
            select_backend(CPU, torch.float32, None, name)
    assert type(select_backend(CUDA, torch.bfloat16, 12, "torch")) is TorchBackend     # any block size


def test_block_size_defaults_and_checks():
    assert TorchBackend().fit_block_size(None) == 16 and TorchBackend().fit_block_size(12) == 12
    assert CpuBackend().fit_block_size(None) == 16
    flash = object.__new__(FlashBackend)         # without flash-attn installed: the policy only
    assert flash.fit_block_size(None) == 256 and flash.fit_block_size(512) == 512
    with pytest.raises(ValueError, match="flash-attn's paged KV cache needs a multiple of 256 as "
                                         "kvcache_block_size, got 128"):
        flash.fit_block_size(128)


def test_flash_prepare_gives_varlen_key_offsets():
    """flash-attn's prefill reads cu_seqlens_k (each row's whole context); only that backend adds it."""
    lens = torch.tensor([5, 1, 300, 17], dtype=torch.int32)
    ctx = Context(is_prefill=True, context_lens=lens)
    object.__new__(FlashBackend).prepare(ctx)
    assert ctx.cu_seqlens_k.dtype == torch.int32 and ctx.cu_seqlens_k.tolist() == [0, 5, 6, 306, 323]
    decode = Context(is_prefill=False, context_lens=lens)
    object.__new__(FlashBackend).prepare(decode)
    TorchBackend().prepare(ctx := Context(is_prefill=True, context_lens=lens))
    assert decode.cu_seqlens_k is None and ctx.cu_seqlens_k is None


@pytest.mark.parametrize("backend,tp", [("torch", 1), ("cpu", 1),
                                        pytest.param("torch", 2, marks=(pytest.mark.spawn, pytest.mark.slow))])
def test_engine_on_a_chosen_backend_matches_transformers(tiny_model_dir, hf_model, backend, tp):
    llm = LLM(tiny_model_dir, tensor_parallel_size=tp, attention_backend=backend, **SMALL)
    try:
        assert f"attention {backend}," in llm.engine.runner.describe() and llm.config.attention_backend == backend
        prompts = mixed_prompts(llm.config.model_config.vocab_size, lengths=(3, 40) if tp == 1 else (5, 33))
        out = llm.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, o in zip(prompts, out):
            assert o.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
    finally:
        llm.close()


@pytest.mark.spawn
@pytest.mark.slow
def test_auto_resolves_to_a_name_the_workers_get(tiny_model_dir, monkeypatch):
    """Rank 0 writes its choice (and block size) into the config the workers start from: a worker that cannot
    run the named backend fails by name instead of quietly running another one."""
    from nanovllm_tp.distributed.launch import config_to_json
    llm = LLM(tiny_model_dir, **SMALL)
    try:
        assert llm.config.attention_backend == "cpu"
        assert '"attention_backend": "cpu"' in config_to_json(llm.config)
    finally:
        llm.close()
    assert cpu_kernels.load() is not None       # rank 0 keeps the kernels it loaded; the spawned worker has no
    monkeypatch.setenv("CC", "/nonexistent/cc")  # compiler, so none
    with pytest.raises(PeerError, match=r"(?s)rank 1: .*attention_backend=cpu, but the C kernels are not available"):
        LLM(tiny_model_dir, tensor_parallel_size=2, attention_backend="cpu", **SMALL)


def test_command_line_flag_reaches_the_engine(tiny_model_dir):
    import argparse

    from nanovllm_tp.launch.generate import add_engine_args, build_llm
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).attention_backend == "auto"
    llm = build_llm(parser.parse_args(["--model", tiny_model_dir, "--device", "cpu", "--attention-backend", "torch",
                                       "--block-size", "16", "--kv-cache-memory", str(32 << 20)]))
    try:
        assert "attention torch," in llm.engine.runner.describe()
    finally:
        llm.close()
