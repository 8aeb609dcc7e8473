"""Sliding-window models against transformers: a Mistral checkpoint whose 48-token window is far shorter than
its prompts, its generations and max_model_len (1024), through chunked prefill (a first chunk longer than the
window), prefix-cache hits, preemption, both CPU attention backends and TP 1 and 2; and the per-layer windows
read from each config format."""
import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.config.engine_config import ModelConfig
from nanovllm_tp.launch.make_tiny import make_tiny_arch
from tests.engine.test_models import edited
from tests.helpers import greedy_then_prefix_hits, hf_greedy, mixed_prompts, shared_prefix_prompts

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
    assert llm.config.max_model_len == 1024 and llm.config.model_config.layer_windows == (WINDOW,) * 3
    first, again = greedy_then_prefix_hits(llm, prompts, GREEDY, repeat=2)
    assert first == expected and again == expected[-2:]


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


def test_kv_blocks_in_use_stop_growing_at_the_window(mistral):
    path, hf, prompts, _ = mistral
    prompt, new = prompts[1], 4 * WINDOW
    llm = LLM(path, kvcache_block_size=16, kv_cache_memory=8 << 20)
    bm = llm.engine.scheduler.block_manager
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.add_request(prompt, params)
    in_use, tokens = [], None
    while llm.has_unfinished_requests():
        for out in llm.step():
            tokens = out.outputs[0].token_ids
        in_use.append(bm.num_blocks - bm.num_free_blocks)
    # the window's 3 blocks, the partly filled ones at either end of it, and one block of slack
    bound = WINDOW // 16 + 3
    assert max(in_use) <= bound < -(-(len(prompt) + new) // 16), in_use
    assert in_use[-1] == 0 and bm.num_window_freed_blocks > 0
    assert tokens == hf_greedy(hf, prompt, new)
    # the released blocks kept their KV and hashes: the same prompt hits them, and the tokens stay exact
    hits = bm.num_prefix_hit_tokens
    again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert bm.num_prefix_hit_tokens - hits == 32 and again == tokens


def test_speculative_decoding_in_the_window_equals_transformers(mistral):
    path, hf, prompts, _ = mistral
    # a passage, transformers' continuation of it, the passage again: the n-gram proposer offers the
    # continuation once more, and the model takes some of it
    passage = prompts[3][:60]
    prompt = passage + hf_greedy(hf, passage, 12) + passage
    llm = LLM(path, kvcache_block_size=16, kv_cache_memory=8 << 20,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2})
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True), use_tqdm=False)
    stats = llm.stats()
    assert stats["num_draft_tokens"] > 0 and stats["num_accepted_tokens"] > 0, stats
    assert out[0].outputs[0].token_ids == hf_greedy(hf, prompt, NEW)
    assert llm.engine.scheduler.block_manager.num_window_freed_blocks > 0


@pytest.mark.parametrize("kind", ["qwen3", "qwen2"])
def test_qwen_windows_on_some_layers_equal_transformers(kind, tmp_path):
    # use_sliding_window with max_window_layers: the first layers attend to everything, the others to 24 tokens
    import torch
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_tiny import make_tiny
    window = dict(use_sliding_window=True, sliding_window=24, max_window_layers=2)
    if kind == "qwen3":
        hf = AutoModelForCausalLM.from_pretrained(make_tiny(tmp_path, **window), dtype=torch.float32).eval()
    else:
        hf = make_tiny_arch(tmp_path, "qwen2", **window)
    llm = LLM(str(tmp_path), kvcache_block_size=16, kv_cache_memory=8 << 20, max_num_batched_tokens=40,
              max_model_len=1024)
    windows = llm.config.model_config.layer_windows
    assert windows[:2] == (0, 0) and set(windows[2:]) == {24}
    prompts = mixed_prompts(hf.config.vocab_size, lengths=(30, 90), seed=3)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 40) for p in prompts]
    assert llm.engine.scheduler.block_manager.window == 0, "global layers read every block: none is released"
