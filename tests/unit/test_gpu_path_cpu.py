"""The CUDA path's host-side pieces, checked on CPU: the graph batch ladder, padding, the pinned decode
input buffers, KV sizing and the profile steps, block-size checks and the choice of CUDA backend (flash-attn
present or not), teardown order, graph-capture fallback, the flash-attn pin and the GPU check script.

Nothing here needs a GPU; tests/unit/test_triton_kernels.py checks the Triton kernels, tests/gpu what needs a device.
"""
import json
import math
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from nanovllm_tp.layers.attention.torch_sdpa import TorchBackend
from nanovllm_tp.scheduler.plan import DECODE, StepPlan
from nanovllm_tp.workers.cuda_graph import DecodeInputs, block_table_width, graph_batch_sizes, padded_batch_size
from nanovllm_tp.workers.kv_cache import blocks_for_budget, gpu_kv_budget, kv_block_bytes

REPO = pathlib.Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- graph ladder and padding

@pytest.mark.parametrize("max_num_seqs", [1, 2, 7, 8, 9, 16, 17, 100, 256, 300])
def test_graph_batch_sizes_ladder(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)), "sorted and unique"
    assert sizes[0] == 1 and sizes[-1] == max_num_seqs
    assert all(1 <= s <= max_num_seqs for s in sizes)
    assert set(s for s in (1, 2, 4, 8) if s <= max_num_seqs) <= set(sizes), "small sizes first"
    gaps = np.diff([0] + sizes)
    assert gaps.max() <= 16, "a decode step never pads by more than 15 rows"
    # the ladder stays short: captures cost time and graph-pool memory
    assert len(sizes) <= 4 + math.ceil(max_num_seqs / 16) + 1


def test_graph_batch_sizes_known_values():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(7) == [1, 2, 4, 7]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(17) == [1, 2, 4, 8, 16, 17]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256] and len(graph_batch_sizes(256)) == 20
    assert graph_batch_sizes(300)[-2:] == [288, 300]


@pytest.mark.parametrize("max_num_seqs", [1, 7, 16, 17, 100, 256, 300])
def test_padded_batch_size_every_row_count(max_num_seqs):
    sizes = graph_batch_sizes(max_num_seqs)
    for rows in range(1, max_num_seqs + 1):
        padded = padded_batch_size(rows, sizes)
        assert padded in sizes and padded >= rows
        smaller = [s for s in sizes if s < padded]
        assert not smaller or smaller[-1] < rows, f"{rows} rows should use the smallest graph that fits"
    assert padded_batch_size(max_num_seqs + 1, sizes) is None


def test_padded_batch_size_edges():
    sizes = graph_batch_sizes(256)
    assert [padded_batch_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 255, 256)] == \
        [1, 2, 4, 4, 8, 8, 16, 16, 32, 48, 256, 256]


@pytest.mark.parametrize("block_size", [8, 16, 32, 128, 256])
@pytest.mark.parametrize("max_model_len", [2, 15, 16, 17, 255, 256, 257, 4096, 40961])
def test_block_table_width_covers_max_model_len(block_size, max_model_len):
    width = block_table_width(max_model_len, block_size)
    assert width * block_size >= max_model_len > (width - 1) * block_size


# ---------------------------------------------------------------- pinned decode inputs

def make_decode_plan(context_lens, block_tables, block_size, vocab=1000, seed=0) -> StepPlan:
    """A decode StepPlan: row i's new token sits at position context_lens[i] - 1."""
    rng = np.random.default_rng(seed)
    context_lens = np.asarray(context_lens, np.int32)
    rows = len(context_lens)
    table = np.full((rows, max(len(t) for t in block_tables)), -1, np.int32)
    for i, t in enumerate(block_tables):
        table[i, :len(t)] = t
    positions = context_lens.astype(np.int64) - 1
    slots = table[np.arange(rows), positions // block_size].astype(np.int64) * block_size + positions % block_size
    return StepPlan(step_id=1, kind=DECODE, input_ids=rng.integers(0, vocab, rows).astype(np.int64),
                    positions=positions, slot_mapping=slots,
                    cu_seqlens_q=np.arange(rows + 1, dtype=np.int32), context_lens=context_lens,
                    block_tables=table)


def test_decode_inputs_fill_pads_and_copies_only_the_used_width():
    bs, null_slot = 16, 999 * 16
    inputs = DecodeInputs(max_rows=16, width=8, device=torch.device("cpu"))
    assert all(not t.is_pinned() for t in inputs.host.values())      # pinning only on CUDA
    big = make_decode_plan([5, 17, 33, 64, 100], [[1], [2, 3], [4, 5, 6], [7, 8, 9, 10],
                                                  [11, 12, 13, 14, 15, 16, 17]], bs, seed=1)
    inputs.fill(big, rows=8, null_slot=null_slot)
    d = {k: v[:8] for k, v in inputs.device.items() if k != "block_tables"}
    table = inputs.block_tables[:8]
    assert torch.equal(d["input_ids"][:5], torch.from_numpy(big.input_ids))
    assert torch.equal(d["positions"][:5], torch.from_numpy(big.positions))
    assert torch.equal(d["slot_mapping"][:5], torch.from_numpy(big.slot_mapping))
    assert torch.equal(d["context_lens"][:5], torch.from_numpy(big.context_lens))
    assert torch.equal(table[:5, :7], torch.from_numpy(big.block_tables))
    assert (table[:5, 7:] == -1).all()
    # padding rows: null slot, no context, no blocks, token 0 at position 0
    assert (d["slot_mapping"][5:] == null_slot).all() and (d["context_lens"][5:] == 0).all()
    assert (table[5:] == -1).all()
    assert (d["input_ids"][5:] == 0).all() and (d["positions"][5:] == 0).all()
    # host and device agree on every filled row
    for k in d:
        assert torch.equal(inputs.host[k][:8], d[k]), k

    small = make_decode_plan([3, 20], [[40], [41, 42]], bs, seed=2)
    inputs.fill(small, rows=4, null_slot=null_slot)
    d = {k: v[:4] for k, v in inputs.device.items() if k != "block_tables"}
    table = inputs.block_tables[:4]
    assert torch.equal(table[:2, :2], torch.from_numpy(small.block_tables))
    assert (table[2:, :2] == -1).all(), "rows of the earlier, larger plan must not survive in the used width"
    # only the 2 used columns were copied: the wider plan's columns are still there (and never read, since
    # every row's context ends inside its first 2 blocks)
    assert table[0, 2:7].tolist() == [-1] * 5 and table[1, 2:7].tolist() == [-1] * 5
    assert table[2, 2:3].tolist() == [6] and table[3, 2:4].tolist() == [9, 10]
    assert d["context_lens"].tolist() == [3, 20, 0, 0]
    assert d["slot_mapping"].tolist() == small.slot_mapping.tolist() + [null_slot, null_slot]
    assert d["input_ids"][2:].tolist() == [0, 0] and d["positions"].tolist() == [2, 19, 0, 0]

    ctx = inputs.context(4)
    assert not ctx.is_prefill and ctx.context_lens.shape == (4,) and ctx.block_tables.shape == (4, 8)
    assert ctx.slot_mapping.dtype == torch.int64 and ctx.context_lens.dtype == torch.int32
    assert ctx.block_tables.dtype == torch.int32
    # the context views alias the persistent buffers (what a captured graph reads)
    assert ctx.block_tables.data_ptr() == inputs.block_tables.data_ptr()
    with pytest.raises(ValueError, match="9 block-table columns"):
        inputs.fill(make_decode_plan([140], [list(range(9))], bs), rows=1, null_slot=null_slot)


# ---------------------------------------------------------------- KV sizing arithmetic

def test_kv_block_bytes():
    # 2 (K and V) * layers * block * kv_heads * head_dim * element size
    assert kv_block_bytes(4, 16, 2, 32, torch.float32) == 2 * 4 * 16 * 2 * 32 * 4 == 32768
    assert kv_block_bytes(4, 16, 2, 32, torch.bfloat16) == 16384
    assert kv_block_bytes(28, 16, 8, 128, torch.bfloat16) == 2 * 28 * 16 * 8 * 128 * 2     # Qwen3-0.6B
    assert kv_block_bytes(28, 256, 8, 128, torch.float16) == 16 * kv_block_bytes(28, 16, 8, 128, torch.bfloat16)


def test_blocks_for_budget_reserves_the_null_block():
    assert blocks_for_budget(10 * 1000, 1000) == 9
    assert blocks_for_budget(10 * 1000 + 999, 1000) == 9       # partial blocks don't count
    assert blocks_for_budget(1000, 1000) == 0
    assert blocks_for_budget(999, 1000) == 0
    assert blocks_for_budget(0, 1000) == 0
    assert blocks_for_budget(-5 << 30, 1000) == 0               # a negative budget (weights > budget)


def test_gpu_kv_budget():
    gib = 1 << 30
    total = 140 * gib
    # weights 1.2 GiB in use now, warm-up peak 3 GiB above that
    assert gpu_kv_budget(total, 0.9, int(1.2 * gib), 3 * gib) == int(total * 0.9) - int(1.2 * gib) - 3 * gib
    assert gpu_kv_budget(total, 0.5, 10 * gib, 0) < gpu_kv_budget(total, 0.9, 10 * gib, 0)
    assert gpu_kv_budget(total, 0.1, 20 * gib, gib) < 0          # the caller turns this into zero blocks
    # the budget plus what is already used never exceeds utilization * total
    for util in (0.3, 0.5, 0.9):
        used, peak = 7 * gib, 2 * gib
        assert gpu_kv_budget(total, util, used, peak) + used + peak <= util * total


# ---------------------------------------------------------------- backend block-size checks

@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 128, 256, 1024])
def test_cuda_torch_backend_accepts_power_of_two_blocks(block_size):
    from nanovllm_tp.layers.attention.torch_cuda import CudaTorchBackend
    object.__new__(CudaTorchBackend).fit_block_size(block_size)


@pytest.mark.parametrize("block_size", [1, 4, 12, 24, 100, 768, 2048])
def test_cuda_torch_backend_rejects_other_blocks(block_size):
    from nanovllm_tp.layers.attention.torch_cuda import CudaTorchBackend
    with pytest.raises(ValueError, match=rf"power of two in \[8, 1024\] as kvcache_block_size, got {block_size}"):
        object.__new__(CudaTorchBackend).fit_block_size(block_size)


def test_flash_backend_block_sizes():
    from nanovllm_tp.layers.attention.flash import FlashBackend
    backend = object.__new__(FlashBackend)
    for ok in (256, 512, 1024):
        backend.fit_block_size(ok)
    for bad in (16, 128, 255, 300):
        with pytest.raises(ValueError, match=rf"multiple of 256 as kvcache_block_size, got {bad}"):
            backend.fit_block_size(bad)


# ---------------------------------------------------------------- CUDA backend choice, flash-attn present or not

BF16, FP32 = torch.bfloat16, torch.float32


@pytest.mark.parametrize("flash_ok,dtype,block_size,want", [
    (True, BF16, None, "flash"), (True, BF16, 256, "flash"), (True, BF16, 512, "flash"),
    (True, BF16, 16, "torch-cuda"), (True, BF16, 128, "torch-cuda"),     # an explicit block flash cannot use
    (True, FP32, None, "torch-cuda"), (True, FP32, 256, "torch-cuda"),   # flash-attn has no fp32
    (False, BF16, None, "torch-cuda"), (False, BF16, 16, "torch-cuda"), (False, BF16, 256, "torch-cuda"),
])
def test_cuda_backend_choice(flash_ok, dtype, block_size, want, caplog):
    from nanovllm_tp.layers.attention.registry import pick_cuda_backend
    with caplog.at_level("INFO", logger="nanovllm_tp"):
        assert pick_cuda_backend(dtype, block_size, flash_ok, None) == want
    said = " ".join(r.getMessage() for r in caplog.records)
    if want == "flash":
        assert not said
    else:     # every fall-back says why, in one line
        assert "torch-cuda" in said
        reason = ("multiple of 256" if flash_ok and dtype == BF16 else "not installed" if not flash_ok else
                  "does not support torch.float32")
        assert reason in said, said
        assert (f"kvcache_block_size={block_size}" in said) == (flash_ok and dtype == BF16)


@pytest.mark.parametrize("flash_ok", [True, False])
@pytest.mark.parametrize("block_size", [12, 768, 2048])
def test_cuda_backend_choice_block_size_no_backend_takes(flash_ok, block_size):
    from nanovllm_tp.layers.attention.registry import pick_cuda_backend
    if flash_ok and block_size % 256 == 0:      # flash-attn takes it
        assert pick_cuda_backend(BF16, block_size, flash_ok, None) == "flash"
        block_size = 1292       # neither rule holds
    with pytest.raises(ValueError) as err:
        pick_cuda_backend(BF16, block_size, flash_ok, None)
    text = str(err.value)
    assert f"kvcache_block_size={block_size} fits no CUDA attention backend" in text
    assert "power of two in [8, 1024]" in text
    assert ("multiple of 256" in text) == (block_size % 256 != 0) and ("(installed)" in text) == flash_ok
    assert ("not installed" in text) != flash_ok


def test_cuda_backend_choice_forced():
    from nanovllm_tp.layers.attention.registry import pick_cuda_backend
    assert pick_cuda_backend(BF16, 256, True, "torch-cuda") == "torch-cuda"
    assert pick_cuda_backend(BF16, None, True, "flash") == "flash"
    with pytest.raises(ValueError, match=r"=flash, but flash-attn's paged KV cache needs a multiple of 256 "
                                         r"\(kvcache_block_size=16\)"):
        pick_cuda_backend(BF16, 16, True, "flash")
    with pytest.raises(ValueError, match="=flash, but flash-attn is not installed"):
        pick_cuda_backend(BF16, 256, False, "flash")
    with pytest.raises(ValueError, match=r"=flash, but flash-attn does not support torch.float32"):
        pick_cuda_backend(FP32, 256, True, "flash")
    with pytest.raises(ValueError, match="fits no CUDA attention backend"):
        pick_cuda_backend(BF16, 12, True, "torch-cuda")


def test_cuda_backend_choice_with_this_machines_flash_attn(caplog):
    """The same choice with the real availability flag of this environment (flash-attn installed or not)."""
    from nanovllm_tp.layers.attention.flash import flash_available
    from nanovllm_tp.layers.attention.registry import pick_cuda_backend
    present = flash_available()
    assert pick_cuda_backend(BF16, None, present, None) == ("flash" if present else "torch-cuda")
    assert pick_cuda_backend(BF16, 16, present, None) == "torch-cuda"


def test_backend_graph_support_flags():
    from nanovllm_tp.layers.attention.flash import FlashBackend
    from nanovllm_tp.layers.attention.torch_cuda import CudaTorchBackend
    assert TorchBackend.supports_graphs is False      # reads host-side lengths: never captured
    assert CudaTorchBackend.supports_graphs and FlashBackend.supports_graphs


# ---------------------------------------------------------------- no CUDA graphs on CPU

def test_cpu_engine_never_builds_graphs(tiny_model_dir, monkeypatch):
    import nanovllm_tp.workers.cuda_graph as cuda_graph

    from nanovllm_tp import LLM, SamplingParams
    from nanovllm_tp.layers.attention.registry import select_backend

    def refuse(*args, **kwargs):
        raise AssertionError("a CUDAGraphRunner was built on CPU")

    monkeypatch.setattr(cuda_graph, "CUDAGraphRunner", refuse)
    monkeypatch.setattr(cuda_graph, "profile_kv_budget", refuse)
    for cuda_only in ("torch-cuda", "flash"):      # asking for a CUDA backend on CPU is refused by name
        with pytest.raises(ValueError, match=rf"attention_backend={cuda_only} runs on cuda, not cpu"):
            select_backend(torch.device("cpu"), torch.float32, None, cuda_only)
    llm = LLM(tiny_model_dir, device="cpu", enforce_eager=False, kvcache_block_size=16, kv_cache_memory=32 << 20,
              max_num_seqs=4)
    try:
        runner = llm.engine.runner
        assert runner.graphs is None and runner.device.type == "cpu"
        assert "attention cpu" in runner.describe()
        out = llm.generate([[1, 2, 3], [4, 5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    finally:
        llm.close()


# ---------------------------------------------------------------- teardown order, graph runner lifetime, fallback

def _load_teardown_recorder():
    import importlib.util
    path = REPO / "tests" / "tp_scripts" / "teardown_order" / "sitecustomize.py"
    spec = importlib.util.spec_from_file_location("teardown_recorder", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.spawn
@pytest.mark.slow
def test_teardown_releases_runner_before_destroying_the_process_group(tiny_model_dir, tmp_path, monkeypatch):
    """Rank 0 and the worker each drop graphs + KV cache before destroy_process_group (NCCL hangs destroying
    a communicator that live graphs captured), with no ModelRunner holding a KV cache left at that moment."""
    from nanovllm_tp import LLM, SamplingParams
    log_path = tmp_path / "teardown.jsonl"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [
        str(REPO / "tests" / "tp_scripts" / "teardown_order"), str(REPO), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("NVTP_TEST_TEARDOWN_LOG", str(log_path))
    recorder = _load_teardown_recorder()
    recorder.install(str(log_path), setattr=monkeypatch.setattr)
    others = recorder.live_kv_runners()      # engines other tests of this process keep alive
    llm = LLM(tiny_model_dir, tensor_parallel_size=2, device="cpu", kvcache_block_size=16,
              kv_cache_memory=16 << 20, max_num_seqs=4)
    try:
        out = llm.generate([[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.close()
    events = [json.loads(line) for line in log_path.read_text().splitlines()]
    for rank in ("0", "1"):
        mine = [(e["event"], e["live_kv_runners"]) for e in events if e["rank"] == rank]
        base = others if rank == "0" else 0
        assert mine == [("release", base), ("destroy", base)], f"rank {rank}: {mine}"


def _cpu_runner(tiny_model_dir):
    from nanovllm_tp.config.engine_config import EngineConfig
    from nanovllm_tp.distributed.parallel_state import set_tp
    from nanovllm_tp.layers.attention.cpu_paged import CpuBackend
    from nanovllm_tp.workers.worker import build_runner
    config = EngineConfig(model=tiny_model_dir, device="cpu", kvcache_block_size=16, kv_cache_memory=8 << 20,
                          max_model_len=256, max_num_seqs=4)
    config.validate()
    set_tp(0, 1, None)
    return build_runner(config, torch.device("cpu"), torch.float32, CpuBackend())


def test_graph_runner_does_not_keep_the_model_runner_alive(tiny_model_dir):
    """No runner <-> graph-runner cycle: dropping the last reference frees the runner (and its KV cache) at
    once, without the cycle collector."""
    import gc
    import weakref

    from nanovllm_tp.workers.cuda_graph import CUDAGraphRunner
    runner = _cpu_runner(tiny_model_dir)
    runner.graphs = CUDAGraphRunner(runner, 4, 256)     # buffers only: capture needs CUDA
    assert runner.graphs.null_slot == runner.null_slot and runner.graphs.model is runner.model
    gone = weakref.ref(runner)
    gc.collect()
    gc.disable()
    try:
        del runner
        assert gone() is None, "a reference cycle keeps the ModelRunner (and its KV cache) alive"
    finally:
        gc.enable()


def test_graph_capture_failure_falls_back_to_eager(tiny_model_dir, caplog):
    """Capture raises here for real (no CUDA): the runner gets no graphs, a warning says so, and it decodes."""
    from nanovllm_tp.workers.cuda_graph import capture_decode_graphs
    runner = _cpu_runner(tiny_model_dir)
    try:
        with caplog.at_level("WARNING", logger="nanovllm_tp"):
            assert capture_decode_graphs(runner, 4, 256) is None
        assert any("CUDA graph capture failed" in r.getMessage() and "eagerly" in r.getMessage()
                   for r in caplog.records)
        plan = make_decode_plan([3, 20], [[0], [1, 2]], runner.block_size)
        logits = runner.execute(plan)
        assert logits.shape[0] == 2 and torch.isfinite(logits).all()
    finally:
        runner.release()


# ---------------------------------------------------------------- packaging and the GPU check script

def test_cuda_extra_pins_flash_attn_to_the_checked_range():
    import configparser

    from packaging.requirements import Requirement
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    (req,) = [Requirement(line) for line in cfg["options.extras_require"]["cuda"].splitlines() if line.strip()]
    assert req.name == "flash-attn"
    assert all(req.specifier.contains(v) for v in ("2.6.3", "2.8.3", "2.8.3.post1"))
    assert not any(req.specifier.contains(v) for v in ("2.8.4", "2.9.0", "3.0.0", "2.5.9"))


@pytest.mark.spawn
def test_gpu_check_script_uses_python3_when_python_is_absent(tmp_path):
    """A fresh image has python3 only: the script must start the check with it (here just --help)."""
    import shutil
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    marker = tmp_path / "python3_was_used"
    (bin_dir / "python3").write_text(f'#!/bin/sh\n: > "{marker}"\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python3").chmod(0o755)
    (bin_dir / "dirname").symlink_to(shutil.which("dirname"))
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path)}
    proc = subprocess.run([shutil.which("bash"), str(REPO / "scripts" / "gpu_check.sh"), "--help"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout and "--dry-run" in proc.stdout
    assert marker.exists()


# ---------------------------------------------------------------- KV profiling runs the worst steps

@pytest.mark.parametrize("tokens,max_len,max_rows", [(300, 256, 4), (8192, 40960, 256), (8192, 512, 8),
                                                     (100, 2, 256), (16, 4096, 1), (5, 64, 16)])
def test_profile_plans_cover_the_worst_steps(tokens, max_len, max_rows):
    from types import SimpleNamespace

    from nanovllm_tp.workers.cuda_graph import profile_plans
    config = SimpleNamespace(max_num_batched_tokens=tokens, max_model_len=max_len, max_num_seqs=max_rows)
    plain, prefixed = profile_plans(config, block_size=16)
    for plan in (plain, prefixed):
        q = np.diff(plan.cu_seqlens_q)
        assert plan.is_prefill and 1 <= plan.num_rows <= max_rows and (q >= 1).all()
        assert (plan.context_lens <= max_len).all() and (q <= plan.context_lens).all()
        assert plan.num_tokens == q.sum() <= tokens
        # positions end at each row's context length; slots follow the (identity) block table
        ends = plan.positions[plan.cu_seqlens_q[1:] - 1]
        assert (ends == plan.context_lens - 1).all()
        rows_of = np.repeat(np.arange(plan.num_rows), q)
        table = plan.block_tables[rows_of, plan.positions // 16]
        assert (table >= 0).all() and (table.astype(np.int64) * 16 + plan.positions % 16 == plan.slot_mapping).all()
    # nothing cached, the longest prompts first
    assert (plain.context_lens == np.diff(plain.cu_seqlens_q)).all()
    assert plain.num_tokens == min(tokens, max_rows * max_len) and plain.context_lens[0] == min(tokens, max_len)
    # every row over a full max_model_len context with a cached prefix; as many rows and tokens as allowed;
    # the first row is the longest chunk a prompt can have over a prefix
    q = np.diff(prefixed.cu_seqlens_q)
    assert (prefixed.context_lens == max_len).all() and (q < max_len).all()
    assert prefixed.num_rows == min(max_rows, tokens)
    assert prefixed.num_tokens == min(tokens, prefixed.num_rows * (max_len - 1))
    assert q[0] == min(tokens - prefixed.num_rows + 1, max_len - 1)


def test_profile_steps_run_through_the_model_over_a_temporary_cache(tiny_model_dir):
    """The profile's steps run for real (here on CPU, the CUDA path measures memory around the same call):
    both plans execute, the cached-prefix one reads the temporary cache, and the cache is dropped after."""
    from nanovllm_tp.workers.cuda_graph import run_profile_steps
    runner = _cpu_runner(tiny_model_dir)
    config = runner.config
    config.max_num_batched_tokens = 300
    executed, real_execute = [], runner.execute

    def execute(plan):
        logits = real_execute(plan)
        executed.append((plan, logits))
        return logits

    runner.execute = execute
    try:
        during = run_profile_steps(runner, config, measure=lambda: (runner.num_kv_blocks, runner.k_cache.shape))
        assert during[0] == 256 // 16 and during[1][1] == 256 // 16 + 1       # one max_model_len sequence + null
        assert [p.num_tokens for p, _ in executed] == [300, 300]
        assert bool((executed[1][0].context_lens > np.diff(executed[1][0].cu_seqlens_q)).all())
        for plan, logits in executed:
            assert logits.shape[0] == plan.num_rows and torch.isfinite(logits).all()
        assert runner.k_cache is None and runner.num_kv_blocks == 0
        assert all(a.k_cache.numel() == 0 for a in runner.attention_layers)
    finally:
        runner.release()
