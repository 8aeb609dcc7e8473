"""Sliding-window models against transformers: a Mistral checkpoint whose 48-token window is far shorter than
its prompts, its generations and max_model_len (1024), through chunked prefill (a first chunk longer than the
window), prefix-cache hits, preemption, both CPU attention backends and TP 1 and 2; and the per-layer windows
read from each config format."""
import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.config import ModelConfig
from nanovllm_tp.launch.make_tiny import make_tiny_arch
from tests.engine.test_models import edited
from tests.helpers import hf_greedy, mixed_prompts, shared_prefix_prompts

WINDOW, NEW = 48, 80
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
# the Mistral arch has 3 layers, 2 kv heads of 32: 24 KiB per fp32 block of 16 tokens
BLOCK_BYTES = 2 * 3 * 16 * 2 * 32 * 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """(model directory, transformers model, prompts, transformers' greedy tokens for each)."""
    path = tmp_path_factory.mktemp("mistral-window")
    hf = make_tiny_arch(path, "mistral", sliding_window=WINDOW)
    vocab = hf.config.vocab_size
    prompts = mixed_prompts(vocab, lengths=(5, 47, 100, 130), seed=3) + \
        shared_prefix_prompts(vocab, prefix_len=70, tails=(3, 30), seed=4)
    return str(path), hf, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


def test_the_window_changes_transformers_tokens(mistral):
    # else the tests below would pass with a backend that ignores the window
    _, hf, prompts, expected = mistral
    hf.config.sliding_window = None      # read at every forward: the same weights, full attention
    try:
        assert hf_greedy(hf, prompts[3], NEW) != expected[3]
    finally:
        hf.config.sliding_window = WINDOW


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=(pytest.mark.spawn, pytest.mark.slow))],
                         ids=["tp1", "tp2"])
def test_greedy_equals_transformers_with_chunks_and_prefix_hits(mistral, tp):
    path, _, prompts, expected = mistral
    llm = LLM(path, tensor_parallel_size=tp, kvcache_block_size=16, kv_cache_memory=8 << 20,
              max_num_batched_tokens=64)
    try:
        assert llm.config.max_model_len == 1024 and llm.config.model_config.layer_windows == (WINDOW,) * 3
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        hits = llm.engine.scheduler.block_manager.num_prefix_hit_tokens
        again = llm.generate(prompts[-2:], GREEDY, use_tqdm=False)
        assert llm.engine.scheduler.block_manager.num_prefix_hit_tokens > hits
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in again] == expected[-2:]


def test_preempted_requests_equal_transformers_on_the_torch_backend(mistral):
    path, _, prompts, expected = mistral
    # max_model_len 256 needs 16 blocks; a 20-block pool holds about two of the six requests at once
    llm = LLM(path, attention_backend="torch", kvcache_block_size=16, max_model_len=256,
              kv_cache_memory=20 * BLOCK_BYTES)
    try:
        out = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert llm.stats()["num_preemptions"] > 0
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in out] == expected


@pytest.mark.parametrize("changes, windows", [
    (dict(use_sliding_window=True, sliding_window=64, max_window_layers=2), (0, 0, 64, 64)),
    (dict(use_sliding_window=False, sliding_window=64), (0, 0, 0, 0)),
    (dict(use_sliding_window=True, sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2),
     (32, 0, 32, 0)),
])
def test_layer_windows_follow_the_config(changes, windows, tmp_path, tiny_model_dir):
    config = ModelConfig.from_pretrained(edited(tiny_model_dir, tmp_path, **changes))
    assert config.layer_windows == windows
    assert config.sliding_window == (max(windows) or None)


@pytest.mark.parametrize("changes, message", [
    (dict(use_sliding_window=True, sliding_window=32, layer_types=["chunked_attention"] * 4), "chunked_attention"),
    (dict(use_sliding_window=True, sliding_window=32, layer_types=["sliding_attention"] * 3), "layer_types"),
])
def test_unknown_layer_types_are_refused(changes, message, tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(edited(tiny_model_dir, tmp_path, **changes))
