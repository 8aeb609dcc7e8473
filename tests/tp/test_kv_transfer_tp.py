"""A request moved between two TP = 2 engines with its KV (engine/kv_transfer.py, workers/kv_blocks.py): rank 0
gathers each rank's KV heads into the payload (rank i's i-th: the heads transformers computes for the same tokens)
and hands each rank of the importer its own; the importer decodes on without computing the prompt again, with
transformers' tokens (fp32) or the unmoved run's (int8 KV); a payload of another TP size is refused by name, either
way; an engine that drafts moves its draft's KV too. (A process holds one multi-rank engine at a time: the exporter
closes before the importer starts.)"""
import numpy as np
import pytest
import torch

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.engine.kv_payload import KVPayload
from nanovllm_tp.engine.kv_transfer import export_request, import_request
from tests.helpers import hf_greedy

pytestmark = [pytest.mark.spawn, pytest.mark.slow]
BS = 16
KNOBS = {"kvcache_block_size": BS, "kv_cache_memory": 16 << 20, "max_model_len": 512}
PROMPT = list(range(7, 7 + 45))          # two full blocks and a partial one
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def run_for(llm: LLM, rid: str, prompt, params, count: int) -> list[int]:
    llm.add_request(prompt, params, request_id=rid)
    got = []
    for _ in range(count):
        for out in llm.step():
            got = list(out.outputs[0].token_ids)
    return got


def finish(llm: LLM) -> list[int]:
    got = []
    while llm.has_unfinished_requests():
        for out in llm.step():
            got.extend(out.outputs[0].token_ids)
    return got


def hf_keys_values(hf_model, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """transformers' cache after these tokens: per layer (keys, values), [kv heads, tokens, head dim]."""
    with torch.no_grad():
        cache = hf_model(torch.tensor([tokens]), use_cache=True).past_key_values
    return [(layer.keys[0], layer.values[0]) for layer in cache.layers]


def test_a_tp2_request_moves_to_another_tp2_engine_with_every_rank_s_heads(tiny_model_dir, hf_model):
    want = hf_greedy(hf_model, PROMPT, GREEDY.max_tokens)
    first = LLM(tiny_model_dir, tensor_parallel_size=2, **KNOBS)
    try:
        before = run_for(first, "r", PROMPT, GREEDY, 5)
        payload = export_request(first, "r")
        assert first.stats()["kv_cache_usage"] == 0.0 and first.stats()["kv_transfer"]["blocks_out"] == 4
    finally:
        first.close()
    assert before == want[:5]
    p = KVPayload.decode(payload)
    assert p.layout.tp_size == 2 and p.layout.num_kv_heads == 1
    layers, hd, cached = p.layout.num_layers, p.layout.head_dim, len(PROMPT) + 4
    ref = hf_keys_values(hf_model, PROMPT + before[:4])
    for part, which in (("k", 0), ("v", 1)):
        got = np.frombuffer(p.completions[0].kv[part], np.float32).reshape(2, layers, 4 * BS, 1, hd)[:, :, :cached, 0]
        for layer in range(layers):
            for rank in range(2):      # rank i holds KV head i
                torch.testing.assert_close(torch.from_numpy(got[rank, layer].copy()), ref[layer][which][rank],
                                           rtol=1e-4, atol=1e-4)

    one = LLM(tiny_model_dir, **KNOBS)
    try:
        with pytest.raises(ValueError, match="layout.tp_size is 2, this engine's is 1"):
            import_request(one, payload)
        assert one.stats()["num_waiting"] == 0
        one.add_request(PROMPT, GREEDY, request_id="one")
        for _ in range(3):
            one.step()
        tp1_payload = export_request(one, "one")
    finally:
        one.close()

    second = LLM(tiny_model_dir, tensor_parallel_size=2, **KNOBS)
    try:
        with pytest.raises(ValueError, match="layout.tp_size is 1, this engine's is 2"):
            import_request(second, tp1_payload)
        assert import_request(second, payload) == "r"
        after = finish(second)
        stats = second.stats()
        assert before + after == want
        # only the decoded tokens ran here: the prompt and the first 5 tokens came with the KV
        assert stats["num_computed_tokens"] == len(after)
        assert stats["kv_transfer"]["blocks_in"] == 4 and stats["kv_transfer"]["completions_recomputed"] == 0
    finally:
        second.close()


def test_an_int8_cache_s_scales_move_with_each_rank_s_values(tiny_model_dir):
    knobs = {**KNOBS, "kv_cache_dtype": "int8"}
    first = LLM(tiny_model_dir, tensor_parallel_size=2, **knobs)
    try:
        unmoved = run_for(first, "whole", PROMPT, GREEDY, GREEDY.max_tokens)
        before = run_for(first, "r", PROMPT, GREEDY, 3)
        payload = export_request(first, "r")
    finally:
        first.close()
    p = KVPayload.decode(payload)
    kv = p.completions[0].kv
    assert sorted(kv) == ["k", "k_scale", "v", "v_scale"]
    # [tp, layers, blocks, block size, heads] of fp32; [..., head dim] of int8
    assert len(kv["k_scale"]) == 2 * p.layout.num_layers * 3 * BS * 1 * 4
    assert len(kv["k"]) == 2 * p.layout.num_layers * 3 * BS * 1 * p.layout.head_dim
    second = LLM(tiny_model_dir, tensor_parallel_size=2, **knobs)
    try:
        import_request(second, payload)
        assert before + finish(second) == unmoved
        assert second.stats()["kv_transfer"]["completions_recomputed"] == 0
    finally:
        second.close()


def test_a_tp2_engine_that_drafts_moves_the_draft_s_kv_too(tiny_model_dir, tmp_path):
    """TP 2 with a draft model (the draft on rank 0 alone): the target's KV gathered from both ranks, the draft's
    read on rank 0, both written on import; the importer's tokens are transformers' (greedy on the target), and its
    draft proposes as unmoved: accepted before + after the move = the unmoved run's."""
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_tiny import make_tiny
    target = str(make_tiny(tmp_path / "qwen3-6", num_hidden_layers=6, quiet_from=4))
    spec = {"method": "draft_model", "model": tiny_model_dir, "num_speculative_tokens": 3}
    knobs = {**KNOBS, "enable_prefix_caching": False, "speculative_config": spec}
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval(), PROMPT,
                     GREEDY.max_tokens)
    first = LLM(target, tensor_parallel_size=2, **knobs)
    try:
        accepted = first.stats()["num_accepted_tokens"]
        assert first.generate([PROMPT], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want
        accepted_whole, accepted = first.stats()["num_accepted_tokens"] - accepted, first.stats()["num_accepted_tokens"]
        before = run_for(first, "r", PROMPT, GREEDY, 3)
        accepted_first = first.stats()["num_accepted_tokens"] - accepted
        payload = export_request(first, "r")
    finally:
        first.close()
    assert sorted(KVPayload.decode(payload).completions[0].kv) == ["draft_k", "draft_v", "k", "v"]
    second = LLM(target, tensor_parallel_size=2, **knobs)
    try:
        import_request(second, payload)
        assert before + finish(second) == want
        assert accepted_first + second.stats()["num_accepted_tokens"] == accepted_whole
    finally:
        second.close()


def test_a_caller_behind_a_tp2_export_resumes_from_what_it_saw(tiny_model_dir, hf_model):
    """A rolling restart of a TP 2 replica exports after more tokens than its client read: kv_for_resume cuts every
    rank's part of the KV back to the caller's 2 tokens (across a block boundary: 45 prompt tokens, blocks of 16,
    the export holds 12 tokens), and the importer goes on from there with transformers' tokens, computing only the
    tokens after them."""
    from nanovllm_tp.engine.kv_transfer import kv_for_resume
    from nanovllm_tp.engine.resume import ResumedChoice
    from nanovllm_tp.sampling_params import RequestOutputKind
    want = hf_greedy(hf_model, PROMPT, GREEDY.max_tokens)
    first = LLM(tiny_model_dir, tensor_parallel_size=2, **KNOBS)
    try:
        assert run_for(first, "r", PROMPT, GREEDY, 12) == want[:12]
        payload = export_request(first, "r")
    finally:
        first.close()
    second = LLM(tiny_model_dir, tensor_parallel_size=2, **KNOBS)
    try:
        choices = [ResumedChoice(0, want[:2], 0)]
        entries = kv_for_resume(second, payload, PROMPT, choices)
        assert entries[0].num_cached_tokens == len(PROMPT) + 1
        delta = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        second.add_requests([PROMPT], delta, ["r"], resume=[choices], kv=[entries])
        assert want[:2] + finish(second) == want
        assert second.stats()["num_computed_tokens"] == len(want) - 2
        assert second.stats()["kv_transfer"]["blocks_in"] == 3
    finally:
        second.close()
