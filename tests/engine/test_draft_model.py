"""Speculative decoding with a draft model: the tiny checkpoint drafts for a deeper one of the same tokenizer
(make_tiny's quiet_from: most proposals right, not all). Greedy output equals transformers' on the target through
chunked prefill, prefix hits, n > 1, preemption and TP 2; a draft equal to the target has every proposal
accepted; seeded sampling gives the tokens plain decoding gives; logprobs of kept positions are transformers'; the
refusals name what is wrong."""
import json
import shutil

import numpy as np
import pytest
import torch

from nanovllm_tp import LLM, SamplingParams
from tests.helpers import hf_greedy
from tests.engine.test_speculative import TEXTS, assert_greedy_under_preemption

SMALL = dict(kvcache_block_size=16, kv_cache_memory=32 << 20)


def draft_spec(model, k: int = 4) -> dict:
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    from nanovllm_tp.launch.make_tiny import make_tiny
    return str(make_tiny(tmp_path_factory.mktemp("deep") / "qwen3-6", num_hidden_layers=6, quiet_from=4))


@pytest.fixture(scope="module")
def hf_target(target_dir):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def drafted(target_dir, tiny_model_dir):
    llm = LLM(target_dir, speculative_config=draft_spec(tiny_model_dir), max_num_batched_tokens=32, **SMALL)
    yield llm
    llm.close()


def accepted_since(llm, before: dict) -> tuple[int, int]:
    after = llm.stats()
    return (after["num_draft_tokens"] - before["num_draft_tokens"],
            after["num_accepted_tokens"] - before["num_accepted_tokens"])


def test_draft_config_is_refused_by_name(target_dir, tiny_model_dir, tmp_path):
    bad_vocab = tmp_path / "other-vocab"
    shutil.copytree(tiny_model_dir, bad_vocab)
    tokenizer = json.loads((bad_vocab / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]                  # two tokens swap ids: same size, another vocabulary
    (bad_vocab / "tokenizer.json").write_text(json.dumps(tokenizer))
    spec = draft_spec(tiny_model_dir)
    for bad, exc, match in [({**spec, "model": None}, TypeError, "needs model"),
                            ({**spec, "model": str(tmp_path / "nowhere")}, ValueError, "does not exist"),
                            ({**spec, "draft_tensor_parallel_size": 2}, ValueError,
                             "draft_tensor_parallel_size=2 is not implemented"),
                            ({**spec, "prompt_lookup_max": 3}, ValueError, "unknown key.*'prompt_lookup_max'"),
                            ({**spec, "num_speculative_tokens": 0}, ValueError, "num_speculative_tokens must be"),
                            ({**spec, "model": str(bad_vocab)}, ValueError, "another vocabulary")]:
        with pytest.raises(exc, match=match):
            LLM(target_dir, speculative_config=bad, **SMALL)
    short = tmp_path / "short-context"
    shutil.copytree(tiny_model_dir, short)
    config = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    with pytest.raises(ValueError, match="speculative_config model .*max_model_len=256 exceeds"):
        LLM(target_dir, speculative_config={**spec, "model": str(short)}, max_model_len=256, **SMALL)


def test_greedy_with_a_draft_equals_transformers(drafted, hf_target):
    """Chunked prefill (the long prompt, 32-token steps), a second round over prefix-cache hits, n = 2 siblings
    (their block copies reach the draft's cache too), and per-position counts that add up."""
    tok = drafted.get_tokenizer()
    prompts = [tok.encode(t) for t in TEXTS] + [tok.encode(TEXTS[3]) * 3]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    want = [hf_greedy(hf_target, p, 48) for p in prompts]
    before = drafted.stats()
    for _ in range(2):
        out = drafted.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == want
    pair = drafted.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, n=2),
                            use_tqdm=False)[0]
    assert [c.token_ids for c in pair.outputs] == [want[0]] * 2
    stats = drafted.stats()
    proposed, accepted = accepted_since(drafted, before)
    assert accepted > proposed // 4 and proposed > accepted        # a useful draft, and some proposals missed
    per_pos = np.subtract(stats["num_accepted_tokens_per_pos"], before["num_accepted_tokens_per_pos"])
    assert per_pos.sum() == accepted and (np.diff(per_pos) <= 0).all()    # a place is reached past the earlier
    assert stats["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    assert stats["kv_cache_usage"] == 0.0


def test_logprobs_under_speculation_are_transformers(drafted, hf_target):
    """A request with logprobs takes proposals; each kept position reports the log-softmax of its own logits."""
    tok = drafted.get_tokenizer()
    prompt = tok.encode(TEXTS[1])
    before = drafted.stats()
    c = drafted.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
                         use_tqdm=False)[0].outputs[0]
    proposed, accepted = accepted_since(drafted, before)
    assert accepted > 0
    assert c.token_ids == hf_greedy(hf_target, prompt, 24) and len(c.logprobs) == 24
    with torch.no_grad():
        logits = hf_target(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1)
    for i, (token, position) in enumerate(zip(c.token_ids, c.logprobs)):
        top = ref[i].topk(2)
        assert position[token].logprob == pytest.approx(float(ref[i, token]), abs=1e-3)
        assert set(position) >= set(top.indices.tolist())
    assert c.cumulative_logprob == pytest.approx(float(ref[torch.arange(24), c.token_ids].sum()), abs=1e-2)


def test_seeded_sampling_is_what_plain_decoding_samples(drafted, target_dir):
    """Every position is sampled as plain decoding samples it (same seed, same token index): the drafted
    engine's seeded samples are the plain engine's."""
    plain = LLM(target_dir, **SMALL)
    try:
        tok = plain.get_tokenizer()
        prompts = [tok.encode(t) for t in TEXTS]
        params = [SamplingParams(temperature=0.7, top_p=0.9, max_tokens=40, ignore_eos=True, seed=s)
                  for s in range(len(prompts))]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    finally:
        plain.close()
    before = drafted.stats()
    got = [o.outputs[0].token_ids for o in drafted.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert accepted_since(drafted, before)[1] > 0


def test_a_draft_equal_to_the_target_is_always_right(tiny_model_dir, hf_model):
    """(Without a method, a model makes it draft_model, as in vLLM.)"""
    llm = LLM(tiny_model_dir, speculative_config={"model": tiny_model_dir, "num_speculative_tokens": 3}, **SMALL)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(t) for t in TEXTS[:2]]
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        for p, o in zip(prompts, out):
            assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 40)
        stats = llm.stats()
        assert stats["num_draft_tokens"] >= 20
        assert stats["num_accepted_tokens"] >= 0.95 * stats["num_draft_tokens"]
        # the draft's KV comes out of the same budget: fewer blocks than the target alone would get
        assert stats["num_kv_blocks"] < (32 << 20) // llm.engine.runner.kv_block_bytes() - 1
    finally:
        llm.close()


@pytest.mark.slow
def test_greedy_with_a_draft_under_preemption(target_dir, tiny_model_dir, hf_target):
    llm = LLM(target_dir, speculative_config=draft_spec(tiny_model_dir), kvcache_block_size=16,
              kv_cache_memory=21 * 81920, max_model_len=256)     # 20 blocks
    assert_greedy_under_preemption(llm, hf_target, 100)


@pytest.mark.spawn
@pytest.mark.slow
def test_greedy_with_a_draft_at_tp2(target_dir, tiny_model_dir, hf_target):
    """The target over two ranks, the draft on rank 0 alone."""
    llm = LLM(target_dir, tensor_parallel_size=2, speculative_config=draft_spec(tiny_model_dir),
              max_num_batched_tokens=32, **SMALL)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(t) for t in TEXTS]
        out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, n=2),
                           use_tqdm=False)
        for p, o in zip(prompts, out):
            assert [c.token_ids for c in o.outputs] == [hf_greedy(hf_target, p, 48)] * 2
        assert llm.stats()["num_accepted_tokens"] > 0
    finally:
        llm.close()


def test_a_request_moves_with_its_draft_s_kv(target_dir, tiny_model_dir, hf_target):
    """A request moved between two engines that draft with the same model (engine/kv_transfer.py) takes the
    draft's KV along with the target's: the importer decodes transformers' tokens without computing the prompt
    again, and its draft proposes exactly what it would have proposed unmoved (the tokens it had accepted before
    the move plus after it are the unmoved run's). A payload without the draft's KV, or into an engine without
    the draft, is refused by name."""
    from nanovllm_tp.engine.kv_payload import KVPayload
    from nanovllm_tp.engine.kv_transfer import export_request, import_request
    knobs = dict(SMALL, enable_prefix_caching=False, speculative_config=draft_spec(tiny_model_dir))
    first, second = LLM(target_dir, **knobs), LLM(target_dir, **knobs)
    plain = LLM(target_dir, **SMALL)
    try:
        prompt = first.get_tokenizer().encode(TEXTS[0] * 3)
        greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        before = first.stats()
        whole = first.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
        assert whole == hf_greedy(hf_target, prompt, 40)
        _, accepted_whole = accepted_since(first, before)
        computed_whole = first.stats()["num_computed_tokens"] - before["num_computed_tokens"]
        before = first.stats()
        first.add_request(prompt, greedy, request_id="m")
        got = []
        for _ in range(3):
            for out in first.step():
                got = list(out.outputs[0].token_ids)
        _, accepted_first = accepted_since(first, before)
        computed_first = first.stats()["num_computed_tokens"] - before["num_computed_tokens"]
        payload = export_request(first, "m")
        p = KVPayload.decode(payload)
        assert p.draft is not None and p.draft.num_layers < p.layout.num_layers
        assert sorted(p.completions[0].kv) == ["draft_k", "draft_v", "k", "v"]
        with pytest.raises(ValueError, match="draft_layout: the KV comes with a draft model's, this engine runs none"):
            import_request(plain, payload)
        before, computed = second.stats(), second.stats()["num_computed_tokens"]
        import_request(second, payload)
        while second.has_unfinished_requests():
            for out in second.step():
                got.extend(out.outputs[0].token_ids)
        assert got == whole
        _, accepted_second = accepted_since(second, before)
        assert accepted_first + accepted_second == accepted_whole and accepted_second > 0
        assert second.stats()["kv_transfer"]["completions_recomputed"] == 0
        # the prompt and the tokens before the move came with their KV: the two engines computed what one did
        assert computed_first + second.stats()["num_computed_tokens"] - computed == computed_whole
        plain.add_request(prompt, greedy, request_id="p")
        plain.step()
        with pytest.raises(ValueError, match="draft_layout: the KV comes without a draft model's, this engine runs "
                                             "one"):
            import_request(second, export_request(plain, "p"))
    finally:
        for llm in (first, second, plain):
            llm.close()
