"""LLM.embed equals transformers' AutoModel hidden states pooled by hand (fp32, cosine >= 0.9999): last-token,
mean and CLS pooling as the model's files say, chunked prefill, prefix-cache hits, mixed with generation,
Matryoshka dimensions; bad input is refused before the engine and the engine keeps serving."""
import os

import pytest
import torch

from nanovllm_tp import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams
from tests.embedding_helpers import cosine, hf_embedding, model_copy
from tests.helpers import GGUF, GGUF_DIR, hf_greedy, mixed_prompts, smollm2

SMALL_KV = dict(kvcache_block_size=16, kv_cache_memory=64 << 20)
CLOSE = 0.9999


@pytest.fixture(scope="module")
def hf_base(tiny_model_dir):
    from transformers import AutoModel
    return AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tiny_llm):
    return mixed_prompts(tiny_llm.config.model_config.vocab_size, lengths=(1, 9, 40, 130, 300), seed=7)


def assert_all_blocks_free(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def assert_matches(outs, hf_base, prompts, **pooling):
    for i, (o, p) in enumerate(zip(outs, prompts)):
        want = hf_embedding(hf_base, p, **pooling)
        assert o.outputs.hidden_size == len(want)
        assert cosine(o.outputs.embedding, want) >= CLOSE, f"prompt {i} (len {len(p)})"
        if pooling.get("normalize", True):
            assert abs(torch.tensor(o.outputs.embedding).norm() - 1) < 1e-4
        else:       # unnormalized: the vector itself, not only its direction
            assert torch.allclose(torch.tensor(o.outputs.embedding), want, rtol=1e-3, atol=1e-4)


def test_last_token_normalized_by_default(tiny_llm, hf_base, prompts):
    """No sentence-transformers files: the last token's hidden state, normalized; every prompt form."""
    tok = tiny_llm.get_tokenizer()
    inputs = [*prompts, "hello world", {"prompt": "the quick brown fox"}, {"prompt_token_ids": prompts[1]}]
    outs = tiny_llm.embed(inputs, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outs)
    assert outs[-3].prompt_token_ids == tok.encode("hello world")
    assert_matches(outs, hf_base, [o.prompt_token_ids for o in outs])
    assert len({o.request_id for o in outs}) == len(outs)
    assert_all_blocks_free(tiny_llm)      # prefill only: nothing kept after it


def test_mean_and_cls_pooling_chunked_without_prefix_hits(tiny_model_dir, tmp_path, hf_base, prompts):
    """sentence-transformers mean pooling (+ Normalize), summed over prompt chunks of 48 tokens; a repeated prompt
    takes no prefix-cache hit (every hidden state is needed) and still matches. CLS without Normalize."""
    mean_dir = model_copy(tiny_model_dir, str(tmp_path / "mean"), "pooling_mode_mean_tokens")
    llm = LLM(mean_dir, max_num_batched_tokens=48, enable_prefix_caching=True, **SMALL_KV)
    try:
        assert_matches(llm.embed(prompts, use_tqdm=False), hf_base, prompts, kind="MEAN")
        hits = llm.engine.scheduler.block_manager.num_prefix_hit_tokens
        assert_matches(llm.embed(prompts[-2:], use_tqdm=False), hf_base, prompts[-2:], kind="MEAN")
        assert llm.engine.scheduler.block_manager.num_prefix_hit_tokens == hits
        assert_all_blocks_free(llm)
    finally:
        llm.close()
    cls_dir = model_copy(tiny_model_dir, str(tmp_path / "cls"), "pooling_mode_cls_token", normalize=False)
    llm = LLM(cls_dir, max_num_batched_tokens=48, **SMALL_KV)
    try:
        assert_matches(llm.embed(prompts, use_tqdm=False), hf_base, prompts, kind="CLS", normalize=False)
    finally:
        llm.close()
    llm = LLM(tiny_model_dir, pooler_config={"pooling_type": "MEAN", "normalize": False}, **SMALL_KV)   # vLLM's knob
    try:
        assert_matches(llm.embed(prompts, use_tqdm=False), hf_base, prompts, kind="MEAN", normalize=False)
    finally:
        llm.close()


def test_last_token_uses_prefix_cache(tiny_model_dir, hf_base, prompts):
    """Last-token pooling may start from cached blocks (its last token is always computed), chunked or not."""
    llm = LLM(tiny_model_dir, max_num_batched_tokens=64, enable_prefix_caching=True, **SMALL_KV)
    try:
        long = prompts[-1]
        first = llm.embed([long], use_tqdm=False)[0]
        hits = llm.engine.scheduler.block_manager.num_prefix_hit_tokens
        again = llm.embed([long, long[:200] + [5, 6, 7]], use_tqdm=False)
        assert llm.engine.scheduler.block_manager.num_prefix_hit_tokens - hits >= 400
        assert_matches([first, *again], hf_base, [long, long, long[:200] + [5, 6, 7]])
        assert_all_blocks_free(llm)
    finally:
        llm.close()


def test_mixed_with_generation(tiny_model_dir, hf_model, hf_base, prompts):
    """Embedding rows share steps with decoding rows and with generation prompts after them (whose logits rows
    follow rows that have none), chunked: both stay exact."""
    llm = LLM(tiny_model_dir, max_num_batched_tokens=64, **SMALL_KV)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    try:
        ids = [llm.add_request(p, greedy) for p in prompts[1:3]]
        llm.step()
        llm.step()                  # generation is decoding when the embeddings arrive
        queued = llm.add_requests(prompts[:2], PoolingParams())
        ids.append(llm.add_request(prompts[2], greedy))         # its prompt runs in the same step, after them
        done = {o.request_id: o for o in llm.step() if o.finished}
        assert set(done) == set(queued)
        embeds = llm.embed(prompts, use_tqdm=False)
        assert llm.engine.scheduler.num_mixed_steps > 0
        while llm.has_unfinished_requests():
            done.update((o.request_id, o) for o in llm.step() if o.finished)
        assert_matches([done[i] for i in queued] + embeds, hf_base, prompts[:2] + prompts)
        for rid, p in zip(ids, prompts[1:3] + prompts[2:3]):
            assert done[rid].outputs[0].token_ids == hf_greedy(hf_model, p, 24)
        assert_all_blocks_free(llm)
    finally:
        llm.close()


def test_step_driven_embedding_requests(tiny_llm, hf_base, prompts):
    """add_requests with PoolingParams (vLLM: params of either kind); step() reports each once, finished."""
    ids = tiny_llm.add_requests(prompts[:3], PoolingParams(), request_ids=["e0", "e1", "e2"])
    seen = []
    while tiny_llm.has_unfinished_requests():
        seen += tiny_llm.step()
    assert sorted(o.request_id for o in seen) == ids
    by_id = {o.request_id: o for o in seen}
    assert_matches([by_id[i] for i in ids], hf_base, prompts[:3])
    rid = tiny_llm.add_request(prompts[-1], PoolingParams())      # aborted before it ran: reported, empty
    tiny_llm.abort_request(rid)
    out, = tiny_llm.step()
    assert (out.request_id, out.finished, out.outputs.embedding) == (rid, True, [])
    assert not tiny_llm.has_unfinished_requests()
    assert_all_blocks_free(tiny_llm)


def test_dimensions_normalize_and_truncation(tiny_model_dir, tmp_path, hf_base, prompts):
    """Matryoshka truncation then renormalization (a model that declares it), normalize=False, and
    truncate_prompt_tokens keeping a prompt's last tokens; a prompt may fill max_model_len."""
    mdir = model_copy(tiny_model_dir, str(tmp_path / "matryoshka"), config_extra={"is_matryoshka": True})
    llm = LLM(mdir, max_model_len=256, **SMALL_KV)
    try:
        outs = llm.embed(prompts[:4], PoolingParams(dimensions=32), use_tqdm=False)
        assert_matches(outs, hf_base, prompts[:4], dimensions=32)
        raw = llm.embed(prompts[:4], PoolingParams(normalize=False), use_tqdm=False)
        assert_matches(raw, hf_base, prompts[:4], normalize=False)
        long = prompts[-1]                                         # 300 tokens > max_model_len
        with pytest.raises(ValueError, match="max_model_len"):
            llm.embed([long], use_tqdm=False)
        cut = llm.embed([long, long], [PoolingParams(truncate_prompt_tokens=100),
                                       PoolingParams(truncate_prompt_tokens=-1)], use_tqdm=False)
        assert [o.prompt_token_ids for o in cut] == [long[-100:], long[-256:]]
        assert_matches(cut, hf_base, [long[-100:], long[-256:]])
    finally:
        llm.close()


def test_bad_input_refused_and_engine_keeps_serving(tiny_llm, hf_base, prompts):
    vocab = tiny_llm.config.model_config.vocab_size
    for make, error in [(lambda: PoolingParams(dimensions=0), ValueError),
                        (lambda: PoolingParams(dimensions="8"), TypeError),
                        (lambda: PoolingParams(normalize="yes"), TypeError),
                        (lambda: PoolingParams(truncate_prompt_tokens=0), ValueError)]:
        with pytest.raises(error):
            make()
    with pytest.raises(ValueError, match="Matryoshka"):      # as vLLM: the model does not declare it
        tiny_llm.embed(prompts[:1], PoolingParams(dimensions=16), use_tqdm=False)
    for args, error in [(([],), TypeError), (([[vocab + 3]],), ValueError), (([[1, 2], ""],), ValueError),
                        (([1.5],), TypeError), ((prompts[:2], [PoolingParams()]), ValueError),
                        ((prompts[:1], SamplingParams()), TypeError),
                        ((prompts[:1], PoolingParams(truncate_prompt_tokens=10**6)), ValueError)]:
        with pytest.raises(error):
            tiny_llm.embed(*args, use_tqdm=False)
    assert not tiny_llm.has_unfinished_requests()
    assert_matches(tiny_llm.embed(prompts[:2], use_tqdm=False), hf_base, prompts[:2])


@pytest.mark.slow
@smollm2
def test_smollm2_gguf_embeddings_match_transformers():
    """A real decoder model without sentence-transformers files: last token, normalized; the file's weights
    dequantized (fp32) against transformers reading the same file, and the quantized kernels close to it."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    from transformers import AutoModel
    hf = AutoModel.from_pretrained(GGUF_DIR, gguf_file=os.path.basename(GGUF), dtype=torch.float32).eval()
    texts = ["What is the capital of France?", "A primary color", "The quick brown fox jumps over the lazy dog."]
    for quantization, close in (("none", CLOSE), ("auto", 0.99)):
        llm = LLM(GGUF, dtype="float32", max_model_len=256, quantization=quantization, **SMALL_KV)
        try:
            outs = llm.embed(texts, use_tqdm=False)
        finally:
            llm.close()
        for o in outs:
            assert o.outputs.hidden_size == 576
            assert cosine(o.outputs.embedding, hf_embedding(hf, o.prompt_token_ids)) >= close, quantization
