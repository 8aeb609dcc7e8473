"""packed_linear="auto" at TP 2: each rank chooses kernels for its own shards (measured, written to the shared
cache), then reads back a table whose winners alternate by bucket; greedy tokens stay transformers' both times."""
import pytest

from nanovllm_tp import LLM
from nanovllm_tp.layers.kernel_choice import BUCKETS
from tests.engine.test_kernel_choice_engine import KNOBS, LENGTHS, greedy_matches_transformers, needs_both
from tests.helpers import alternate_kernel_tables, kernel_cache, mixed_prompts


@needs_both
@pytest.mark.spawn
@pytest.mark.slow
def test_tp2_greedy_equals_transformers_with_measured_and_alternating_kernels(tiny_model_dir, hf_model, tmp_path,
                                                                            monkeypatch):
    cache = kernel_cache(tmp_path, monkeypatch)
    prompts = mixed_prompts(hf_model.config.vocab_size, LENGTHS)
    with LLM(tiny_model_dir, tensor_parallel_size=2, **KNOBS) as llm:
        assert not llm.stats()["linear_kernels"]["cached"]
        greedy_matches_transformers(llm, hf_model, prompts)
    shapes = alternate_kernel_tables(cache)
    assert len(shapes) == 1       # both ranks' shards share their shapes: one table
    with LLM(tiny_model_dir, tensor_parallel_size=2, **KNOBS) as llm:
        report = llm.stats()["linear_kernels"]
        assert report["cached"] and [r["winner"] for r in report["table"][:len(BUCKETS)]] == list(
            ("c", "onednn") * 4)[:len(BUCKETS)]
        greedy_matches_transformers(llm, hf_model, prompts)
