"""packed_linear="auto" in an engine: whatever kernel each (shape, row-count bucket) runs, greedy tokens are
transformers' own (fp32); the table the engine measured, then a table whose winners alternate by bucket (read from
the cache), so that one generate call runs both kernels on every layer as its row counts change."""
import pytest
import torch

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.kernel_choice import BUCKETS
from nanovllm_tp.layers.packed_linear import ONEDNN
from tests.helpers import alternate_kernel_tables, hf_greedy, kernel_cache, mixed_prompts

needs_both = pytest.mark.skipif(not (cpu_kernels.load() and torch.float32 in cpu_kernels.load().linear_dtypes
                                     and ONEDNN.can_run(torch.zeros(1, 2))),
                                reason="csrc/linear.c's fp32 kernel or oneDNN does not run on this CPU")
# decode rows fall from 9 through every bucket to 1 as requests finish; prefill chunks of up to 48 rows
LENGTHS = (1, 7, 16, 33, 64, 100, 180, 257, 300)
MAX_TOKENS = (24, 3, 10, 6, 16, 2, 12, 8, 20)
KNOBS = dict(kvcache_block_size=16, kv_cache_memory=32 << 20, max_num_batched_tokens=48, dtype="float32",
             packed_linear="auto")     # whatever $NANOVLLM_TP_PACKED_LINEAR says


def greedy_matches_transformers(llm, hf_model, prompts) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, n, out in zip(prompts, MAX_TOKENS, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, n), len(prompt)


@needs_both
def test_greedy_equals_transformers_whichever_kernel_each_bucket_runs(tiny_model_dir, hf_model, tmp_path,
                                                                      monkeypatch):
    cache = kernel_cache(tmp_path, monkeypatch)
    prompts = mixed_prompts(hf_model.config.vocab_size, LENGTHS)
    with LLM(tiny_model_dir, **KNOBS) as llm:        # measured here, written to the cache
        report = llm.stats()["linear_kernels"]
        assert not report["cached"] and report["amx"]
        greedy_matches_transformers(llm, hf_model, prompts)
    shapes = alternate_kernel_tables(cache)
    assert len(shapes) == 1 and len(next(iter(shapes.values()))) == len(report["table"]) // len(BUCKETS)
    with LLM(tiny_model_dir, **KNOBS) as llm:        # read back: every shape keeps both layouts
        report = llm.stats()["linear_kernels"]
        assert report["cached"] and "c+onednn" in llm.engine.runner.describe()
        winners = [row["winner"] for row in report["table"]]
        assert winners[:2 * len(BUCKETS)] == ["c", "onednn"] * len(BUCKETS)
        assert report["extra_bytes"] > 0 and "+0.0 MiB" not in report["summary"]
        greedy_matches_transformers(llm, hf_model, prompts)
