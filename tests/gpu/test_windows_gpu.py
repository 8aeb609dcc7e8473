"""Sliding windows and logit soft-caps on a CUDA device: the torch-cuda backend (Triton paged decode with split-K,
Triton paged prefill, torch varlen prefill) and flash-attn (window_size, softcap) against attention written out
in fp32 (tests/unit/test_window_attention.reference), with the blocks before each window poisoned; and the
windowed tiny models (Mistral, Gemma 2, Gemma 3, Phi-3) on the GPU in fp32 with CUDA graphs against transformers.
Skipped without CUDA."""
import pytest
import torch

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.utils.context import Context
from tests.helpers import hf_greedy, mixed_prompts, random_paged_cache
from tests.unit.test_window_attention import BLOCK, DIM, GROUP, KV_HEADS, PREFILL_ROWS, SCALE, \
    poison_before_windows, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CASES = [(5, 0.0), (37, 2.0), (0, 2.0)]       # (window, softcap)


def _backends(dtype):
    from nanovllm_tp.layers.attention.flash import FlashBackend, flash_available
    from nanovllm_tp.layers.attention.torch_cuda import CudaTorchBackend
    found = [CudaTorchBackend()]
    if flash_available() and dtype is not torch.float32:
        found.append(FlashBackend())
    return found


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window, softcap", CASES)
def test_decode_on_the_gpu_sees_only_the_window(window, softcap, dtype, tol):
    lens = [1, 5, 17, 40, 300, 1000]
    k_cache, v_cache, table = random_paged_cache(lens, BLOCK, KV_HEADS, DIM, seed=window)
    q = torch.randn(len(lens), KV_HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(1))
    want = reference(q, k_cache, v_cache, table, [(n - 1, 1) for n in lens], window, softcap)
    if window:
        poison_before_windows(k_cache, v_cache, table, lens, window)
    ctx = Context(is_prefill=False, context_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"),
                  block_tables=table.cuda(), context_lens_cpu=lens)
    for backend in _backends(dtype):
        if backend.name == "flash" and backend.block_size_problem(BLOCK):
            continue          # flash-attn's paged cache takes blocks of 256: its engine test below covers it
        got = backend.forward(q.to("cuda", dtype), None, None, k_cache.to("cuda", dtype),
                              v_cache.to("cuda", dtype), ctx, SCALE, window, softcap)
        torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol, msg=backend.name)


@pytest.mark.parametrize("window, softcap", CASES)
def test_prefill_on_the_gpu_sees_only_the_window(window, softcap):
    from nanovllm_tp.layers.attention.torch_cuda import CudaTorchBackend
    lens = [c + n for c, n in PREFILL_ROWS]
    new = [n for _, n in PREFILL_ROWS]
    k_cache, v_cache, table = random_paged_cache(lens, BLOCK, KV_HEADS, DIM, seed=window)
    q = torch.randn(sum(new), KV_HEADS * GROUP, DIM, generator=torch.Generator().manual_seed(5))
    want = reference(q, k_cache, v_cache, table, PREFILL_ROWS, window, softcap)
    if window:
        poison_before_windows(k_cache, v_cache, table, [c + 1 for c, _ in PREFILL_ROWS], window)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ctx = Context(is_prefill=True, cu_seqlens_q=cu, max_seqlen_q=max(new), max_seqlen_k=max(lens),
                  context_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), block_tables=table.cuda(),
                  has_cached_prefix=True, context_lens_cpu=lens, q_lens_cpu=new)
    got = CudaTorchBackend().forward(q.cuda(), None, None, k_cache.cuda(), v_cache.cuda(), ctx, SCALE, window,
                                     softcap)
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch, overrides", [("mistral", dict(sliding_window=48)), ("gemma2", {}),
                                             ("gemma3_text", {}), ("phi3", {})])
def test_windowed_models_on_the_gpu_equal_transformers(arch, overrides, tmp_path, release):
    from nanovllm_tp.launch.make_tiny import make_tiny_arch
    hf = make_tiny_arch(tmp_path, arch, **overrides)
    prompts = mixed_prompts(hf.config.vocab_size, lengths=(5, 60, 200), seed=2)
    llm = LLM(str(tmp_path), dtype="float32", device="cuda", kvcache_block_size=16, kv_cache_memory=256 << 20,
              max_model_len=512, max_num_batched_tokens=64)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        assert llm.stats()["cuda_graph_batch_sizes"], "decode ran in CUDA graphs"
    finally:
        release(llm)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 40) for p in prompts]


@pytest.mark.parametrize("arch, overrides", [("mistral", dict(sliding_window=48)), ("gemma2", {})])
def test_flash_windows_and_caps_agree_with_torch_cuda(arch, overrides, tmp_path, release):
    # flash-attn's window_size and softcap against the Triton kernels, both bf16 (a near tie may flip a token late)
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    from nanovllm_tp.launch.make_tiny import make_tiny_arch
    make_tiny_arch(tmp_path, arch, **overrides)
    prompts = mixed_prompts(2003, lengths=(5, 60, 200, 300), seed=2)
    runs = {}
    for backend, block in (("flash", 256), ("torch-cuda", 16)):
        llm = LLM(str(tmp_path), dtype="bfloat16", device="cuda", attention_backend=backend, kvcache_block_size=block,
                  kv_cache_memory=256 << 20, max_model_len=512)
        try:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                                use_tqdm=False)
        finally:
            release(llm)
        runs[backend] = [o.outputs[0].token_ids for o in outs]
    early = [i for i, (a, b) in enumerate(zip(runs["flash"], runs["torch-cuda"])) if a[:8] != b[:8]]
    assert len(early) <= 1, f"flash vs torch-cuda differ early in prompts {early}"
