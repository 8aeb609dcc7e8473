"""Embeddings at TP 2: rank 0 pools its copy of the final hidden states (replicated after the last all-reduce and
the final norm), equal to transformers; steps mixing embedding and generation rows keep both exact."""
import pytest
import torch

from nanovllm_tp import LLM, PoolingParams, SamplingParams
from tests.embedding_helpers import cosine, hf_embedding, model_copy
from tests.helpers import hf_greedy, mixed_prompts


@pytest.mark.spawn
def test_tp2_embeddings_match_transformers(tiny_model_dir, hf_model, tmp_path):
    from transformers import AutoModel
    hf_base = AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    prompts = mixed_prompts(hf_model.config.vocab_size, lengths=(3, 50, 140), seed=3)
    mean_dir = model_copy(tiny_model_dir, str(tmp_path / "mean"), "pooling_mode_mean_tokens")
    llm = LLM(mean_dir, tensor_parallel_size=2, max_num_batched_tokens=64, kvcache_block_size=16,
              kv_cache_memory=64 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        rid = llm.add_request(prompts[1], greedy)
        llm.step()
        outs = llm.embed(prompts, use_tqdm=False)                               # chunked, beside a decode
        done = {}
        while llm.has_unfinished_requests():
            done.update((o.request_id, o) for o in llm.step() if o.finished)
        # steps of embedding rows only: every rank skips the LM head and its gather
        raw = llm.embed(prompts, [PoolingParams(normalize=False)] * 3, use_tqdm=False)
        for o, p in zip(outs, prompts):
            assert cosine(o.outputs.embedding, hf_embedding(hf_base, p, "MEAN")) >= 0.9999
        for o, p in zip(raw, prompts):
            want = hf_embedding(hf_base, p, "MEAN", normalize=False)
            assert torch.allclose(torch.tensor(o.outputs.embedding), want, rtol=1e-3, atol=1e-4)
        assert done[rid].outputs[0].token_ids == hf_greedy(hf_model, prompts[1], 12)
        children = llm.engine.children
    finally:
        llm.close()
    assert all(c.poll() is not None for c in children)
