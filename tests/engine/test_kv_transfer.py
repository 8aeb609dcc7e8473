"""A running request moved between two engines of one process with its KV (engine/kv_transfer.py): the second
engine decodes on without computing the prompt again, and the tokens are those of a run that never moved (greedy
fp32: transformers' too; bf16 and int8 KV; seeded sampling; n = 2); the imported blocks serve prefix hits; a
payload that does not fit is refused by name before anything is queued, and the engine serves on."""
import msgpack
import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.engine.kv_payload import KVPayload
from nanovllm_tp.engine.kv_transfer import export_request, import_request
from nanovllm_tp.engine.resume import ResumedChoice
from nanovllm_tp.sampling_params import RequestOutputKind
from tests.helpers import hf_greedy

BS = 16
KNOBS = {"kvcache_block_size": BS, "kv_cache_memory": 16 << 20, "max_model_len": 512}
PROMPT = list(range(7, 7 + 45))          # 45 tokens: two full blocks and a partial one
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module", params=["bfloat16", "int8"])
def pair(request, tiny_model_dir):
    """Two engines of one KV format (fp32's are fp32_pair), as two replicas: (first, second, the format)."""
    knobs = dict(KNOBS)
    knobs.update({"dtype": "bfloat16"} if request.param == "bfloat16" else {"kv_cache_dtype": "int8"})
    first, second = LLM(tiny_model_dir, **knobs), LLM(tiny_model_dir, **knobs)
    assert first.stats()["kv_cache_dtype"] == request.param
    yield first, second, request.param
    first.close()
    second.close()


@pytest.fixture(scope="module")
def fp32_pair(tiny_model_dir):
    first, second = LLM(tiny_model_dir, **KNOBS), LLM(tiny_model_dir, **KNOBS)
    yield first, second
    first.close()
    second.close()


def alone(llm: LLM, prompt, params: SamplingParams) -> dict[int, list[int]]:
    """Each completion's tokens of the request run to its end on one engine."""
    return {c.index: c.token_ids for c in llm.generate([prompt], params, use_tqdm=False)[0].outputs}


def steps(llm: LLM, rid: str, count: int) -> dict[int, list[int]]:
    """Step `count` times; each completion's tokens so far as step() reported them (cumulative outputs)."""
    got = {}
    for _ in range(count):
        for out in llm.step():
            if out.request_id == rid:
                got.update({c.index: list(c.token_ids) for c in out.outputs})
    return got


def finish(llm: LLM, rid: str) -> dict[int, list[int]]:
    """Step to the end; each completion's tokens from the delta outputs."""
    got = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.request_id == rid:
                for c in out.outputs:
                    got.setdefault(c.index, []).extend(c.token_ids)
    return got


def move(first: LLM, second: LLM, rid: str, prompt, params: SamplingParams, k: int) -> tuple[dict, dict, bytes]:
    """The request on `first` for k steps, then moved to `second` and finished there: (tokens before the move,
    tokens after it, the payload)."""
    first.add_request(prompt, params, request_id=rid)
    before = steps(first, rid, k)
    payload = export_request(first, rid)
    assert first.stats()["num_running"] == 0 and first.stats()["kv_cache_usage"] == 0.0
    assert import_request(second, payload) == rid
    return before, finish(second, rid), payload


def test_a_greedy_request_moves_with_its_kv_and_is_not_computed_again(fp32_pair, hf_model):
    first, second = fp32_pair
    want = alone(first, PROMPT, GREEDY)[0]
    assert want == hf_greedy(hf_model, PROMPT, GREEDY.max_tokens)
    computed, moved = second.stats()["num_computed_tokens"], second.stats()["kv_transfer"]
    before, after, payload = move(first, second, "greedy", PROMPT, GREEDY, k=5)
    assert len(before[0]) == 5 and before[0] + after[0] == want
    stats = second.stats()
    # the second engine ran one token per step it decoded: the prompt and the first 5 tokens came with the KV
    assert stats["num_computed_tokens"] - computed == len(after[0])
    blocks = -(-(len(PROMPT) + 5 - 1) // BS)
    assert stats["kv_transfer"]["blocks_in"] - moved["blocks_in"] == blocks
    assert stats["kv_transfer"]["completions_recomputed"] == moved["completions_recomputed"]
    assert first.stats()["kv_transfer"]["blocks_out"] >= blocks
    kv = msgpack.unpackb(payload)["completions"][0]["kv"]
    k_cache = second.engine.runner.k_cache          # [layers, blocks, block size, kv heads, head dim], fp32
    assert sorted(kv) == ["k", "v"]
    assert len(kv["k"]) == len(kv["v"]) == k_cache[:, :blocks].numel() * 4
    assert stats["kv_cache_usage"] == 0.0


def test_each_kv_format_moves_bit_for_bit(pair):
    """bf16 and int8 (with its scales) KV moved: the tokens equal an unmigrated run's on the same settings."""
    first, second, kv = pair
    want = alone(first, PROMPT, GREEDY)[0]
    before, after, payload = move(first, second, f"fmt-{kv}", PROMPT, GREEDY, k=3)
    assert before[0] + after[0] == want
    parts = msgpack.unpackb(payload)["completions"][0]["kv"]
    assert sorted(parts) == (["k", "k_scale", "v", "v_scale"] if kv == "int8" else ["k", "v"])


@pytest.mark.parametrize("seen", [0, 2, 4, 9])
def test_a_caller_behind_the_export_resumes_from_what_it_saw(pair, seen):
    """A server's rolling restart: the replica exports its requests after more tokens than the client read (the
    rest was on its way). kv_for_resume cuts each completion's KV to the caller's tokens (back across a block
    boundary: the prompt is 45 tokens, blocks of 16, the export holds 12) and the other engine goes on from there
    with the KV, computing no token again: the tokens equal an unmigrated run's, bf16 and int8 KV."""
    from nanovllm_tp.engine.kv_transfer import kv_for_resume
    first, second, kv = pair
    want = alone(first, PROMPT, GREEDY)[0]
    rid = f"behind-{kv}-{seen}"
    first.add_request(PROMPT, GREEDY, request_id=rid)
    assert steps(first, rid, 12)[0] == want[:12]
    payload = export_request(first, rid)
    choices = [ResumedChoice(0, want[:seen], 0)]
    entries = kv_for_resume(second, payload, PROMPT, choices)
    assert entries[0].num_cached_tokens == len(PROMPT) + seen - 1
    computed, blocks_in = second.stats()["num_computed_tokens"], second.stats()["kv_transfer"]["blocks_in"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    second.add_requests([PROMPT], params, [rid], resume=[choices], kv=[entries])
    after = finish(second, rid)
    assert want[:seen] + after[0] == want
    stats = second.stats()
    assert stats["num_computed_tokens"] - computed == len(want) - seen         # one token per decode step, no prefill
    written = stats["kv_transfer"]["blocks_in"] - blocks_in     # the prompt's full blocks may be cached here
    assert written <= -(-(len(PROMPT) + seen - 1) // BS)
    assert stats["kv_cache_usage"] == 0.0


def test_a_payload_of_another_request_or_a_caller_ahead_of_it_brings_no_kv(fp32_pair):
    """kv_for_resume refuses a payload of another prompt by name; a completion whose caller saw tokens the export
    does not hold (or other tokens) gets no KV and computes them again."""
    from nanovllm_tp.engine.kv_transfer import kv_for_resume
    first, second = fp32_pair
    first.add_request(PROMPT, GREEDY, request_id="ahead")
    got = steps(first, "ahead", 3)[0]
    payload = export_request(first, "ahead")
    with pytest.raises(ValueError, match="prompt_token_ids: not the prompt"):
        kv_for_resume(second, payload, PROMPT[:-1], [ResumedChoice(0, got, 0)])
    assert kv_for_resume(second, payload, PROMPT, [ResumedChoice(0, got + [5], 0)]) == [None]
    assert kv_for_resume(second, payload, PROMPT, [ResumedChoice(0, [got[0] + 1], 0)]) == [None]
    assert kv_for_resume(second, payload, PROMPT, [ResumedChoice(1, got, 0)]) == [None]


@pytest.mark.parametrize("n, k", [(1, 4), (2, 1), (2, 6)], ids=["n1", "n2-after-prefill", "n2"])
def test_a_seeded_sampled_request_goes_on_with_the_same_draws(fp32_pair, n, k):
    """temperature 0.8 with a seed: the noise is a function of the seed and the token index, so the moved request
    draws what it would have. n = 2 right after the prefill: the sibling's block copy has not run yet."""
    first, second = fp32_pair
    params = SamplingParams(n=n, temperature=0.8, seed=77, max_tokens=20, ignore_eos=True)
    want = alone(first, PROMPT, params)
    before, after, _ = move(first, second, f"seeded-{n}-{k}", PROMPT, params, k=k)
    assert sorted(after) == list(range(n))
    for i in range(n):
        assert before[i] + after[i] == want[i]


def test_the_seed_the_first_engine_drew_travels(fp32_pair):
    """Without a seed the first engine draws one; it moves with the request, so the draws go on."""
    first, second = fp32_pair
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    first.add_request(PROMPT, params, request_id="unseeded")
    seq = first._requests["unseeded"].completions[0].seq
    before = steps(first, "unseeded", 3)
    pinned = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=seq.seed)
    assert import_request(second, export_request(first, "unseeded")) == "unseeded"
    after = finish(second, "unseeded")
    assert before[0] + after[0] == alone(first, PROMPT, pinned)[0]


def test_imported_blocks_serve_prefix_hits_and_a_held_prefix_is_not_written(fp32_pair):
    first, second = fp32_pair
    prompt = list(range(100, 100 + 40))
    move(first, second, "prefix", prompt, GREEDY, k=2)
    hits = second.stats()["prefix_cache_hit_tokens"]
    second.generate([prompt + [3, 4]], GREEDY, use_tqdm=False)
    assert second.stats()["prefix_cache_hit_tokens"] - hits == 2 * BS      # the imported full blocks
    written = second.stats()["kv_transfer"]["blocks_in"]
    move(first, second, "prefix-again", prompt, GREEDY, k=2)
    assert second.stats()["kv_transfer"]["blocks_in"] - written == 1       # only the partial block


def test_a_request_that_has_not_run_moves_without_kv_and_is_computed(fp32_pair):
    first, second = fp32_pair
    want = alone(first, PROMPT, GREEDY)[0]
    first.add_request(PROMPT, GREEDY, request_id="waiting")
    recomputed = second.stats()["kv_transfer"]["completions_recomputed"]
    payload = export_request(first, "waiting")
    assert msgpack.unpackb(payload)["completions"][0]["kv"] is None
    import_request(second, payload)
    assert finish(second, "waiting")[0] == want
    assert second.stats()["kv_transfer"]["completions_recomputed"] == recomputed + 1


def _edited(payload: bytes, edit) -> bytes:
    d = msgpack.unpackb(payload, strict_map_key=False)
    edit(d)
    return msgpack.packb(d, use_bin_type=True)


def _set(path: str, value):
    def edit(d):
        *head, last = path.split(".")
        for key in head:
            d = d[int(key)] if isinstance(d, list) else d[key]
        d[last] = value
    return edit


@pytest.mark.parametrize("edit, field", [
    (_set("layout.num_layers", 99), "layout.num_layers"),
    (_set("layout.block_size", 32), "layout.block_size"),
    (_set("layout.kv_dtype", "bfloat16"), "layout.kv_dtype"),
    (_set("layout.head_dim", "64"), "layout.head_dim"),
    (_set("completions.0.num_cached_tokens", 10), "completions[0].num_cached_tokens"),
    (lambda d: d["completions"][0]["kv"].update(k=d["completions"][0]["kv"]["k"][:-4]), "completions[0].kv.k"),
    (lambda d: d["completions"][0]["kv"].pop("v"), "completions[0].kv"),
    (_set("version", 1), "version"),
    (_set("params.tempreature", 0.5), "params"),
    (lambda d: d.update(prompt_token_ids=[]), "prompt_token_ids"),
    ("truncated", "msgpack"),
], ids=["layers", "block-size", "kv-dtype", "head-dim-type", "token-count", "kv-bytes", "kv-part", "version",
        "params", "prompt", "truncated"])
def test_a_payload_that_does_not_fit_is_refused_and_the_engine_serves_on(fp32_pair, edit, field):
    first, second = fp32_pair
    first.add_request(PROMPT, GREEDY, request_id="bad")
    steps(first, "bad", 2)
    good = export_request(first, "bad")
    bad = good[:len(good) // 2] if edit == "truncated" else _edited(good, edit)
    stats = second.stats()
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        import_request(second, bad)
    after = second.stats()
    assert (after["num_running"], after["num_waiting"], after["kv_cache_usage"]) == (0, 0, 0.0)
    assert after["kv_transfer"] == stats["kv_transfer"] and "bad" not in second._requests
    import_request(second, good)          # the same request, whole, still goes on there
    assert len(finish(second, "bad")[0]) == GREEDY.max_tokens - 2


def test_what_does_not_move_is_refused_by_name(fp32_pair):
    first, second = fp32_pair
    with pytest.raises(ValueError, match="not a generation request"):
        export_request(first, "nobody")
    first.add_request(PROMPT, GREEDY, request_id="raw")
    steps(first, "raw", 2)
    payload = KVPayload.decode(export_request(first, "raw"))
    moved = payload.completions[0]
    delta = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    resume = [[ResumedChoice(0, moved.token_ids, 0)]]
    with pytest.raises(ValueError, match="CompletionKV"):      # raw bytes, unchecked, never reach the cache
        second.add_requests([PROMPT], delta, ["raw"], resume=resume, kv=[[moved.kv]])
    moved.kv["k"] = moved.kv["k"][:-1]
    with pytest.raises(ValueError, match=r"completion 0.kv.k has"):
        second.add_requests([PROMPT], delta, ["raw"], resume=resume, kv=[[moved]])
    assert second.stats()["num_running"] == 0 and "raw" not in second._requests


def test_a_request_moves_between_engines_that_speculate(tiny_model_dir):
    """n-gram proposals on both sides: a request moved after steps that accepted proposals (more than one token a
    step, blocks taken for drafts) goes on with the tokens of a run that never moved."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    first, second = (LLM(tiny_model_dir, speculative_config=spec, **KNOBS) for _ in range(2))
    try:
        prompt, params = [5, 6, 7, 8] * 12, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        want = alone(first, prompt, params)[0]
        before, after, _ = move(first, second, "spec", prompt, params, k=9)
        assert len(before[0]) > 9 and before[0] + after[0] == want
        assert second.stats()["num_accepted_tokens"] > 0
    finally:
        first.close()
        second.close()


def test_blocks_are_copied_by_stretches_of_consecutive_ids():
    from nanovllm_tp.workers.kv_blocks import runs
    assert runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 4, 5]) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert runs([0, 1, 2], [7, 8, 3]) == [(0, 7, 2), (2, 3, 1)]
    assert runs([], []) == []
