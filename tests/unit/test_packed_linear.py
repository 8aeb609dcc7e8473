"""Linear layers through packed weights on CPU (csrc/linear.c's layout, or oneDNN's): the matmul against a float64
reference at decode and prefill row counts, which weights get packed how, and a bf16 engine's logprobs against
transformers in fp32."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.kernel_choice import BUCKETS, ChosenWeight, table_of
from nanovllm_tp.layers.packed_linear import (BlockedWeight, linear_paths, matmul, pack_cpu_weights, pack_weight,
                                              packable_dtypes)

needs_bf16 = pytest.mark.skipif(torch.bfloat16 not in packable_dtypes("auto"), reason="no oneDNN bf16 on this CPU")
KERNEL_DTYPES = cpu_kernels.load().linear_dtypes if cpu_kernels.load() else ()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 9, 17, 48, 50, 301])
@pytest.mark.parametrize("out_features,in_features", [(1, 2), (17, 6), (50, 96), (160, 578), (600, 64)])
def test_kernel_rounds_the_exact_product_once(dtype, rows, out_features, in_features):
    """Every output of csrc/linear.c is the float64 product (+ bias) up to fp32 accumulation, rounded once to the
    dtype: odd row chunks and groups, a unit of fewer blocks and a last block of fewer than 16 outputs, k of one
    pair, strided and 3-d activations. The same outputs come from one thread as from two (no output depends on
    the split)."""
    if dtype not in KERNEL_DTYPES:
        pytest.skip(f"csrc/linear.c is not built for {dtype} on this CPU")
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, 3, in_features, generator=g).to(dtype)[:, 1]
    w = torch.randn(out_features, in_features, generator=g).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype)
    packed = pack_weight(w, "c")
    assert isinstance(packed, BlockedWeight) and (packed.out_features, packed.in_features) == tuple(w.shape)
    ulp = 2.0 ** -8 if dtype is torch.bfloat16 else 2.0 ** -23
    for bias in (None, b):
        want = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        bound = want.abs() * ulp + (x.double().abs() @ w.double().abs().T) * in_features * 2.0 ** -23
        got = matmul(x, w, packed, bias)
        assert got.dtype is dtype and got.shape == want.shape
        assert ((got.double() - want).abs() <= bound).all()
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert torch.equal(matmul(x, w, packed, bias), got)
        finally:
            torch.set_num_threads(threads)
    assert matmul(x.reshape(rows, 1, in_features), w, packed).shape == (rows, 1, out_features)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_each_row_is_the_same_in_any_batch(dtype):
    """csrc/linear.c splits a group's rows into chunks of one to eight, each with a loop of its own; a row's outputs
    are the same whichever chunk, chunk size or group it falls in: rows 0..m-1 of an m-row product equal each row
    alone, bit for bit, for every m from 1 to 60 (the batch invariance packed_linear=c promises)."""
    if dtype not in KERNEL_DTYPES:
        pytest.skip(f"csrc/linear.c is not built for {dtype} on this CPU")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(60, 200, generator=g).to(dtype)
    w = torch.randn(70, 200, generator=g).to(dtype)
    packed = pack_weight(w, "c")
    alone = torch.cat([matmul(x[r:r + 1], w, packed) for r in range(60)])
    for m in range(1, 61):
        assert torch.equal(matmul(x[:m], w, packed), alone[:m]), m


@needs_bf16
@pytest.mark.parametrize("rows", [1, 7, 32, 200])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_matmul_matches_a_float64_reference(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 3, 96, generator=g).to(dtype)[:, 1]      # a strided view, as a sliced activation
    w, b = torch.randn(160, 96, generator=g).to(dtype), torch.randn(160, generator=g).to(dtype)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 32)
    want = F.linear(x.double(), w.double(), b.double())
    tol = dict(rtol=1e-2, atol=5e-2) if dtype is torch.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(matmul(x, w, packed, b).double(), want, **tol)
    torch.testing.assert_close(matmul(x, w, packed).double(), want - b.double(), **tol)
    assert matmul(x.reshape(rows, 1, 96), w, packed).shape == (rows, 1, 160)


@needs_bf16
def test_linear_weights_are_packed_as_the_mode_says(tiny_model_dir, monkeypatch):
    from nanovllm_tp import LLM
    from nanovllm_tp.layers.linear import LinearBase
    ours = {dt: BlockedWeight if getattr(torch, dt) in KERNEL_DTYPES else torch.Tensor
            for dt in ("bfloat16", "float32")}
    for dtype, mode, want in [("bfloat16", "auto", ChosenWeight), ("float32", "auto", ChosenWeight),
                              ("float32", "env all", ChosenWeight), ("bfloat16", "c", ours["bfloat16"]),
                              ("float32", "c", ours["float32"]), ("float32", "env c", ours["float32"]),
                              ("float32", "bf16", None),
                              ("bfloat16", "bf16", ours["bfloat16"]), ("bfloat16", "onednn", torch.Tensor),
                              ("float32", "onednn", torch.Tensor), ("bfloat16", "off", None),
                              ("bfloat16", "env 0", None)]:
        if mode.startswith("env "):       # the environment variable gives the knob's default
            monkeypatch.setenv("NANOVLLM_TP_PACKED_LINEAR", mode[4:])
            llm = LLM(tiny_model_dir, dtype=dtype, kv_cache_memory=16 << 20)
            monkeypatch.delenv("NANOVLLM_TP_PACKED_LINEAR")
        else:
            llm = LLM(tiny_model_dir, dtype=dtype, kv_cache_memory=16 << 20, packed_linear=mode)
        try:
            model = llm.engine.runner.model
            linears = [m for m in model.modules() if isinstance(m, LinearBase)]
            assert all(isinstance(m.packed, want) if want else m.packed is None for m in linears), (dtype, mode)
            assert all((m.weight.numel() == 0) == bool(want) for m in linears)
            if want is ChosenWeight:      # the measured choice: its table in stats, one kernel per bucket
                table = llm.stats()["linear_kernels"]["table"]
                assert [r["bucket"] for r in table[:7]] == list(BUCKETS) and len(table) == 7 * len(table_of(model))
                assert len(table_of(model)) == len({(m.weight.dtype, m.packed.choice.shape) for m in linears}) + 1
                assert f"linear {linear_paths(model)} (per bucket: c " in llm.engine.runner.describe()
                continue
            assert llm.stats()["linear_kernels"] is None
            path = {BlockedWeight: "c", torch.Tensor: "onednn", None: "torch"}[want]
            assert f"linear {path}," in llm.engine.runner.describe()
            assert pack_cpu_weights(torch.nn.Linear(2, 2), "auto") == 0     # layers without a packed slot: untouched
        finally:
            llm.close()


@needs_bf16
def test_bf16_engine_logprobs_follow_transformers_fp32(tiny_model_dir, hf_model):
    """Teacher-forced: transformers in fp32 scores the bf16 engine's own greedy tokens. Each chosen token's
    logprob is within a bf16-sized margin of the reference's, and nearly all are the reference's own choice
    (bf16 moves this random model's logprobs by up to ~0.5 nats, enough to flip its near ties)."""
    from nanovllm_tp import LLM, SamplingParams
    llm = LLM(tiny_model_dir, dtype="bfloat16", kv_cache_memory=16 << 20)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 2000, int(rng.integers(3, 150))).tolist() for _ in range(16)]
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=1),
                            use_tqdm=False)
    finally:
        llm.close()
    agree = total = 0
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        with torch.no_grad():
            ref = torch.log_softmax(hf_model(torch.tensor([prompt + c.token_ids])).logits[0].double(), -1)
        for i, t in enumerate(c.token_ids):
            row = ref[len(prompt) - 1 + i]
            assert abs(c.logprobs[i][t].logprob - float(row[t])) < 0.4
            agree += int(row.argmax()) == t
            total += 1
    assert agree >= 0.9 * total


def test_an_unknown_packing_mode_is_refused(tiny_model_dir, monkeypatch):
    from nanovllm_tp import LLM
    with pytest.raises(ValueError, match="packed_linear must be one of 'auto', 'c\\+onednn', 'c', 'bf16', 'onednn', 'off', got 'fp32'"):
        LLM(tiny_model_dir, kv_cache_memory=16 << 20, packed_linear="fp32")
    monkeypatch.setenv("NANOVLLM_TP_PACKED_LINEAR", "fp32")      # the same through the variable's default
    with pytest.raises(ValueError, match="packed_linear must be one of"):
        LLM(tiny_model_dir, kv_cache_memory=16 << 20)
