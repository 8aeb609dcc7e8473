"""The request-lifecycle tests of tests/test_lifecycle.py, run again on a TP=2 engine (spawned workers):
sampling knobs, logprobs, stops, streaming, abort and n > 1 must not depend on how the model is sharded."""
import pytest

from nanovllm_tp import LLM
from tests.test_lifecycle import (  # noqa: F401  (collected here, in this order, with this module's fixtures)
    prompts, test_repetition_penalty_greedy_equals_transformers_generate,
    test_presence_and_frequency_penalties_equal_a_direct_computation,
    test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax, test_stop_strings_split_across_tokens_cut_the_text,
    test_stop_token_ids_and_min_tokens, test_streamed_deltas_concatenate_to_the_final_text,
    test_cumulative_and_final_only_outputs, test_chat_renders_the_template, test_requests_added_before_generate_are_not_lost,
    test_prompt_logprobs_are_whole_across_chunks_and_prefix_hits, test_abort_in_every_state_frees_blocks_and_leaves_others_exact,
    test_n_completions_share_one_prefill)


@pytest.fixture(scope="module")
def tp_size():
    return 2


_shared: dict[str, LLM] = {}


@pytest.fixture(scope="module", autouse=True)
def close_shared():
    yield
    if "llm" in _shared:
        _shared.pop("llm").close()


@pytest.fixture
def tiny_llm(tiny_model_dir):
    """This module's shared engine is a TP=2 one (one multi-rank engine per process at a time, so it is closed
    while a test builds its own, and built again when needed)."""
    llm = _shared.get("llm")
    if llm is None:
        llm = _shared["llm"] = LLM(tiny_model_dir, tensor_parallel_size=2, kvcache_block_size=16,
                                   kv_cache_memory=64 << 20)
        assert llm.engine.local_ranks == [1]
    return llm


@pytest.fixture
def make_llm(tiny_model_dir):
    if "llm" in _shared:
        _shared.pop("llm").close()
    made = []

    def make(**kw):
        made.append(LLM(tiny_model_dir, tensor_parallel_size=2, kvcache_block_size=16, **kw))
        return made[-1]

    yield make
    for llm in made:
        llm.close()
