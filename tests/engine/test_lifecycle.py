"""The request lifecycle against references: penalties vs transformers and a direct computation, logprobs vs
log_softmax, stop strings / stop ids / min_tokens vs the plain greedy text, streaming deltas, abort in every
state, n > 1, chat, and requests that outlive a generate() call."""
import pytest
import torch
from transformers import GenerationConfig

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.engine.output_processor import Detokenizer
from nanovllm_tp.sampling_params import RequestOutputKind
from tests.helpers import hf_greedy, mixed_prompts

N = 24
GREEDY = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)


def greedy_with(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": N, "ignore_eos": True, **kw})


# The lifecycle must not depend on how the model is sharded: a test marked AT_TP_1_AND_2 runs once on TP=1
# engines and once on TP=2 ones (spawned workers); every other test at TP=1.
AT_TP_1_AND_2 = pytest.mark.parametrize(
    "tp_size", [1, pytest.param(2, marks=(pytest.mark.spawn, pytest.mark.slow))], ids=["tp1", "tp2"], indirect=True)
_tp2: dict[str, LLM] = {}


@pytest.fixture(scope="module")
def tp_size(request):
    """The TP size of the engines a test uses: 1, or its AT_TP_1_AND_2 parameter."""
    return getattr(request, "param", 1)


@pytest.fixture(scope="module", autouse=True)
def close_tp2():
    yield
    if "llm" in _tp2:
        _tp2.pop("llm").close()


@pytest.fixture
def tiny_llm(tiny_llm, tp_size, tiny_model_dir):
    """The shared engine at the test's TP size: the session's TP=1 one, or this module's TP=2 one (one multi-rank
    engine per process at a time, so it is closed while a test builds its own, and built again when needed)."""
    if tp_size == 1:
        return tiny_llm
    llm = _tp2.get("llm")
    if llm is None:
        llm = _tp2["llm"] = LLM(tiny_model_dir, tensor_parallel_size=tp_size, kvcache_block_size=16,
                                kv_cache_memory=64 << 20)
        assert llm.engine.local_ranks == [1]
    return llm


@pytest.fixture
def make_llm(tiny_model_dir, tp_size):
    """Engines built by one test at its TP size, closed after it."""
    if tp_size > 1 and "llm" in _tp2:
        _tp2.pop("llm").close()
    made = []

    def make(**kw):
        made.append(LLM(tiny_model_dir, tensor_parallel_size=tp_size, kvcache_block_size=16, **kw))
        return made[-1]

    yield make
    for llm in made:
        llm.close()


@pytest.fixture(scope="module")
def prompts(hf_model):
    return mixed_prompts(hf_model.config.vocab_size, lengths=(5, 17, 40, 70), seed=3)


def hf_reference(hf_model, prompt, steps, process=None, want_logprobs=False):
    """Greedy tokens of transformers over the processed logits (full recompute each step), and the raw
    log_softmax of every step."""
    ids, raws = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
            raws.append(torch.log_softmax(logits, -1))
            if process is not None:
                logits = process(logits.clone(), prompt, ids[len(prompt):])
            ids.append(int(logits.argmax()))
    out = ids[len(prompt):]
    return (out, raws) if want_logprobs else out


def assert_all_blocks_free(llm):
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)


def run_steps(llm) -> dict:
    """Drive step() until nothing is left; every output per request id, in order."""
    seen = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


# ---------------------------------------------------------------- penalties

@AT_TP_1_AND_2
def test_repetition_penalty_greedy_equals_transformers_generate(tiny_llm, hf_model, prompts):
    outs = tiny_llm.generate(prompts, greedy_with(repetition_penalty=1.8), use_tqdm=False)
    gen = GenerationConfig(do_sample=False, max_new_tokens=N, min_new_tokens=N, repetition_penalty=1.8,
                           eos_token_id=-1, pad_token_id=0)
    plain = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    changed = 0
    for p, o, base in zip(prompts, outs, plain):
        want = hf_model.generate(torch.tensor([p]), generation_config=gen)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == want
        changed += o.outputs[0].token_ids != base.outputs[0].token_ids
    assert changed, "the penalty changed nothing: the test would not see it ignored"


@AT_TP_1_AND_2
def test_presence_and_frequency_penalties_equal_a_direct_computation(tiny_llm, hf_model, prompts):
    pres, freq = 1.5, 0.7

    def process(logits, prompt, out):
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        return logits

    outs = tiny_llm.generate(prompts[:3], greedy_with(presence_penalty=pres, frequency_penalty=freq), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_reference(hf_model, p, N, process)
    plain = tiny_llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    assert any(o.outputs[0].token_ids != b.outputs[0].token_ids for o, b in zip(outs, plain))


# ---------------------------------------------------------------- logprobs

@AT_TP_1_AND_2
def test_logprobs_and_prompt_logprobs_equal_transformers_log_softmax(tiny_llm, hf_model, prompts):
    p = prompts[1]
    out = tiny_llm.generate([p], greedy_with(max_tokens=8, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    comp = out.outputs[0]
    want_tokens, raws = hf_reference(hf_model, p, 8, want_logprobs=True)
    assert comp.token_ids == want_tokens and len(comp.logprobs) == 8
    total = 0.0
    for t, pos, raw in zip(comp.token_ids, comp.logprobs, raws):
        assert pos[t].logprob == pytest.approx(float(raw[t]), abs=1e-4) and pos[t].rank == 1
        top = raw.topk(3)
        assert {i: pos[i].rank for i in top.indices.tolist()} == {i: r + 1 for r, i in enumerate(top.indices.tolist())}
        for i, v in zip(top.indices.tolist(), top.values.tolist()):
            assert pos[i].logprob == pytest.approx(v, abs=1e-4)
        assert pos[t].decoded_token == tiny_llm.get_tokenizer().decode([t])
        total += float(raw[t])
    assert comp.cumulative_logprob == pytest.approx(total, abs=1e-3)
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), -1)
    plp = out.prompt_logprobs
    assert len(plp) == len(p) and plp[0] is None
    for i in range(1, len(p)):
        tok = p[i]
        assert plp[i][tok].logprob == pytest.approx(float(ref[i - 1, tok]), abs=1e-4)
        assert plp[i][tok].rank == int((ref[i - 1] > ref[i - 1, tok]).sum()) + 1
        assert len(plp[i]) in (2, 3)          # top-2, plus the prompt token when it is not among them


@AT_TP_1_AND_2
def test_prompt_logprobs_are_whole_across_chunks_and_prefix_hits(make_llm, hf_model, prompts):
    """A chunked prompt, and a prompt whose prefix is cached, still report every prompt position."""
    p = prompts[3]
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([p])).logits[0].float(), -1)
    llm = make_llm(kv_cache_memory=8 << 20, max_model_len=512, max_num_batched_tokens=24)
    for _ in range(2):              # cold and chunked; then with p's blocks in the prefix cache
        out = llm.generate([p], greedy_with(max_tokens=2, prompt_logprobs=0), use_tqdm=False)[0]
        assert len(out.prompt_logprobs) == len(p)
        for i in range(1, len(p)):
            (tok, lp), = out.prompt_logprobs[i].items()
            assert tok == p[i] and lp.logprob == pytest.approx(float(ref[i - 1, tok]), abs=1e-4)
    assert llm.engine.scheduler.block_manager.num_prefix_hit_tokens == 0
    assert_all_blocks_free(llm)


# ---------------------------------------------------------------- stops

@AT_TP_1_AND_2
def test_stop_strings_split_across_tokens_cut_the_text(tiny_llm, prompts):
    tok = tiny_llm.get_tokenizer()
    base = tiny_llm.generate([prompts[2]], GREEDY, use_tqdm=False)[0].outputs[0]
    pieces = [tok.decode(base.token_ids[:i]) for i in range(len(base.token_ids) + 1)]
    k = next(i for i in range(4, len(base.token_ids)) if len(pieces[i]) - len(pieces[i - 1]) >= 2
             and len(pieces[i + 1]) > len(pieces[i]))
    start = len(pieces[k]) - 1
    stop = base.text[start:start + 2]                  # last char of token k-1 + first char of token k
    assert stop not in base.text[:start] and pieces[k].startswith(base.text[:start])
    for include in (False, True):
        comp = tiny_llm.generate([prompts[2]], greedy_with(stop=["@@never@@", stop], include_stop_str_in_output=include),
                                 use_tqdm=False)[0].outputs[0]
        assert comp.text == base.text[:start + (2 if include else 0)]
        assert comp.finish_reason == "stop" and comp.stop_reason == stop
        assert comp.token_ids == base.token_ids[:k + 1]    # the token completing the stop string is kept
    assert_all_blocks_free(tiny_llm)


@AT_TP_1_AND_2
def test_stop_token_ids_and_min_tokens(tiny_llm, hf_model, prompts):
    base = tiny_llm.generate([prompts[0]], GREEDY, use_tqdm=False)[0].outputs[0]
    t = base.token_ids[3]
    first = base.token_ids.index(t)
    comp = tiny_llm.generate([prompts[0]], greedy_with(stop_token_ids=[t]), use_tqdm=False)[0].outputs[0]
    assert comp.token_ids == base.token_ids[:first + 1]
    assert comp.finish_reason == "stop" and comp.stop_reason == t
    assert comp.text == tiny_llm.get_tokenizer().decode(base.token_ids[:first])    # the stop token's text is not
    # min_tokens: the stop id may not be sampled before 6 tokens; afterwards it stops the request
    min_tokens = first + 3

    def process(logits, prompt, out):
        if len(out) < min_tokens:
            logits[t] = float("-inf")
        return logits

    want = hf_reference(hf_model, prompts[0], N, process)
    cut = next((i for i, x in enumerate(want) if x == t and i >= min_tokens), N - 1)
    comp = tiny_llm.generate([prompts[0]], greedy_with(stop_token_ids=[t], min_tokens=min_tokens),
                             use_tqdm=False)[0].outputs[0]
    assert comp.token_ids == want[:cut + 1]
    assert t not in comp.token_ids[:min_tokens]


def test_finish_rule_eos_stop_ids_min_tokens_and_length():
    """One rule for every step kind: EOS beats a stop id beats length; neither counts under min_tokens."""
    import numpy as np
    from nanovllm_tp.scheduler import Sequence
    from nanovllm_tp.scheduler.rows import LENGTH, RUNNING, STOP_EOS, STOP_TOKEN, finish_codes, rows_of
    params = [SamplingParams(max_tokens=3), SamplingParams(stop_token_ids=[7], max_tokens=3),
              SamplingParams(stop_token_ids=[7], min_tokens=3), SamplingParams(ignore_eos=True),
              SamplingParams(min_tokens=2), SamplingParams()]
    seqs = [Sequence(i, [1], p) for i, p in enumerate(params)]
    tokens = np.array([2, 7, 7, 2, 2, 5])
    completion = np.array([3, 3, 3, 1, 2, 1])
    codes = finish_codes(seqs, rows_of(seqs), tokens, completion, completion + 1, np.array([2]), 64)
    assert codes.tolist() == [STOP_EOS, STOP_TOKEN, RUNNING, RUNNING, RUNNING, RUNNING]
    codes = finish_codes(seqs, rows_of(seqs), tokens, completion + 1, completion + 2, np.array([2]), 3)
    assert codes.tolist() == [STOP_EOS, STOP_TOKEN, STOP_TOKEN, LENGTH, STOP_EOS, LENGTH]


# ---------------------------------------------------------------- streaming and detokenization

@pytest.mark.parametrize("library", [True, False], ids=["decode-stream", "python-window"])
def test_detokenizer_never_shows_a_broken_character(tiny_llm, library):
    tok = tiny_llm.get_tokenizer()
    text = " naïve café 日本語 — ünïcödé ✓ end"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())           # multi-byte characters span several tokens
    d = Detokenizer(tok, tok.encode("Say:", add_special_tokens=False), skip_special_tokens=True)
    assert (d.backend is not None) or not library    # the tiny tokenizer is a fast one
    if not library:
        d.backend = None
    for t in ids:
        d.add([t])
        assert "\ufffd" not in d.text and text.startswith(d.text)
    d.add([], final=True)
    assert d.text == text


@AT_TP_1_AND_2
def test_streamed_deltas_concatenate_to_the_final_text(tiny_llm, prompts):
    tok = tiny_llm.get_tokenizer()
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, output_kind=RequestOutputKind.DELTA,
                             stop=["ab"] if s % 2 else None) for s in range(6)]
    ids = [tiny_llm.add_request(prompts[s % len(prompts)], p) for s, p in enumerate(params)]
    seen = run_steps(tiny_llm)
    finals = tiny_llm.generate([prompts[s % len(prompts)] for s in range(6)],
                               [SamplingParams(temperature=1.0, seed=s, max_tokens=40, stop=["ab"] if s % 2 else None)
                                for s in range(6)], use_tqdm=False)
    for rid, final in zip(ids, finals):
        outs = seen[rid]
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        text = "".join(o.outputs[0].text for o in outs if o.outputs)
        tokens = [t for o in outs if o.outputs for t in o.outputs[0].token_ids]
        assert text == final.outputs[0].text and tokens == final.outputs[0].token_ids
        if final.outputs[0].stop_reason is None:    # no stop: the text is the full decode of the tokens
            assert text == tok.decode(tokens, skip_special_tokens=True)
        else:
            assert "ab" not in text


@AT_TP_1_AND_2
def test_cumulative_and_final_only_outputs(tiny_llm, prompts):
    a = tiny_llm.add_request(prompts[0], greedy_with(max_tokens=5))
    b = tiny_llm.add_request(prompts[1], greedy_with(max_tokens=5, output_kind=RequestOutputKind.FINAL_ONLY))
    seen = run_steps(tiny_llm)
    assert [len(o.outputs[0].token_ids) for o in seen[a]] == [1, 2, 3, 4, 5]
    assert len(seen[b]) == 1 and seen[b][0].finished and len(seen[b][0].outputs[0].token_ids) == 5
    m = seen[a][-1].metrics
    assert m.ttft > 0 and m.tpot > 0 and m.num_generation_tokens == 5


def test_stream_interval_groups_tokens_as_vllm_documents(make_llm, tiny_llm, hf_model, prompts):
    """vLLM's stream_interval: a running request's first tokens at once, then an output every N new tokens, its
    end at once; the request's interval is raised to the engine's. The tokens are still transformers' greedy."""
    want = hf_greedy(hf_model, prompts[0], 11)
    a = tiny_llm.add_request(prompts[0], greedy_with(max_tokens=11, output_kind=RequestOutputKind.DELTA,
                                                     stream_interval=4))
    b = tiny_llm.add_request(prompts[1], greedy_with(max_tokens=8, stream_interval=3))     # cumulative
    c = tiny_llm.add_request(prompts[2], greedy_with(n=2, max_tokens=7, output_kind=RequestOutputKind.DELTA,
                                                     stream_interval=3))
    seen = run_steps(tiny_llm)
    assert [len(o.outputs[0].token_ids) for o in seen[a]] == [1, 4, 4, 2]
    assert [t for o in seen[a] for t in o.outputs[0].token_ids] == want
    assert [o.finished for o in seen[a]] == [False, False, False, True]
    assert [len(o.outputs[0].token_ids) for o in seen[b]] == [1, 4, 7, 8]
    for index in (0, 1):        # each completion of an n > 1 request keeps its own count
        deltas = [len(x.token_ids) for o in seen[c] for x in o.outputs if x.index == index and x.token_ids]
        assert deltas == [1, 3, 3]
    llm = make_llm(stream_interval=4)
    d = llm.add_request(prompts[0], greedy_with(max_tokens=11, output_kind=RequestOutputKind.DELTA,
                                                stream_interval=2))
    e = llm.add_request(prompts[1], greedy_with(max_tokens=11, output_kind=RequestOutputKind.DELTA,
                                                stream_interval=6))
    seen = run_steps(llm)
    assert [len(o.outputs[0].token_ids) for o in seen[d]] == [1, 4, 4, 2]       # 2, raised to the engine's 4
    assert [len(o.outputs[0].token_ids) for o in seen[e]] == [1, 6, 4]
    assert [t for o in seen[d] for t in o.outputs[0].token_ids] == want


# ---------------------------------------------------------------- abort

@AT_TP_1_AND_2
def test_abort_in_every_state_frees_blocks_and_leaves_others_exact(make_llm, hf_model, tp_size):
    """Waiting, running, preempted and mid-chunked-prefill requests are aborted; the others still equal
    transformers and every block is free at the end."""
    llm = make_llm(max_model_len=400, kv_cache_memory=41 * 32768 // tp_size, max_num_batched_tokens=64)
    sched = llm.engine.scheduler
    vocab = llm.config.model_config.vocab_size
    keep = mixed_prompts(vocab, lengths=(30, 90), seed=11)
    victims = mixed_prompts(vocab, lengths=(200, 150, 120, 250, 100, 180), seed=12)
    long = SamplingParams(temperature=0, max_tokens=140, ignore_eos=True)
    keep_ids = [llm.add_request(p, GREEDY) for p in keep]
    victim_ids = [llm.add_request(p, long) for p in victims]
    states, seen = {}, {}
    for _ in range(400):
        if not llm.has_unfinished_requests():
            break
        for out in llm.step():
            seen.setdefault(out.request_id, []).append(out)
        by_id = {rid: llm._requests[rid].completions[0].seq for rid in victim_ids if rid in llm._requests}
        for rid, seq in by_id.items():
            if seq.is_finished:
                continue
            if seq in sched.waiting and seq.block_table and seq.num_cached_tokens < seq.num_prompt_tokens:
                state = "mid-chunk"
            elif seq in sched.waiting and seq.num_completion_tokens > 0:
                state = "preempted"
            elif seq in sched.waiting:
                state = "waiting"
            else:
                state = "running"
            if state not in states and (state != "running" or len(states) >= 3):
                states[state] = rid
                llm.abort_request(rid)
                assert seq.is_finished and seq.finish_reason == "abort" and not seq.block_table
    assert set(states) == {"waiting", "mid-chunk", "preempted", "running"}, states
    for rid, outs in run_steps(llm).items():
        seen.setdefault(rid, []).extend(outs)
    for rid, p in zip(keep_ids, keep):
        assert seen[rid][-1].outputs[0].token_ids == hf_greedy(hf_model, p, N)
    for rid in states.values():
        assert seen[rid][-1].outputs[0].finish_reason == "abort" and seen[rid][-1].finished
    llm.abort_request(["no-such-id", keep_ids[0]])         # unknown and finished ids are ignored
    assert_all_blocks_free(llm)


# ---------------------------------------------------------------- n > 1

@AT_TP_1_AND_2
def test_n_completions_share_one_prefill(make_llm, hf_model, prompts):
    llm = make_llm(kv_cache_memory=8 << 20, max_model_len=512)
    sched = llm.engine.scheduler
    p = prompts[2]                                   # 40 tokens: two full blocks and a partial one
    before = sched.num_computed_tokens
    out = llm.generate([p], greedy_with(n=3, max_tokens=10), use_tqdm=False)[0]
    assert sched.num_computed_tokens - before == len(p) + 3 * 9      # one prefill, then 9 decodes per row
    want = hf_greedy(hf_model, p, 10)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.token_ids == want for c in out.outputs)    # the copied partial block holds the right KV
    hot = SamplingParams(temperature=1.0, n=4, seed=7, max_tokens=12)
    first = llm.generate([p], hot, use_tqdm=False)[0]
    again = llm.generate([p], hot, use_tqdm=False)[0]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1
    alone = llm.generate([p], SamplingParams(temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == first.outputs[0].token_ids
    assert_all_blocks_free(llm)


# ---------------------------------------------------------------- API

@AT_TP_1_AND_2
def test_chat_renders_the_template(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    conv = [{"role": "user", "content": "What is the capital of France?"}]
    out = tiny_llm.chat(conv, GREEDY, use_tqdm=False)[0]
    text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    assert out.prompt == text and out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
    assert out.outputs[0].token_ids == tiny_llm.generate([out.prompt_token_ids], GREEDY,
                                                         use_tqdm=False)[0].outputs[0].token_ids
    two = tiny_llm.chat([conv, conv + [{"role": "assistant", "content": "Paris"}]], GREEDY, use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(TypeError, match="messages must be"):
        tiny_llm.chat([{"role": "user"}])
    with pytest.raises(ValueError, match="no chat template"):
        saved, tok.chat_template = tok.chat_template, None
        try:
            tiny_llm.chat(conv)
        finally:
            tok.chat_template = saved


@AT_TP_1_AND_2
def test_requests_added_before_generate_are_not_lost(tiny_llm, hf_model, prompts):
    rid = tiny_llm.add_request(prompts[0], GREEDY)
    out = tiny_llm.generate([prompts[1]], GREEDY, use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model, prompts[1], N)
    seen = run_steps(tiny_llm)
    assert seen[rid][-1].finished and seen[rid][-1].outputs[0].token_ids == hf_greedy(hf_model, prompts[0], N)


def test_bad_requests_are_refused_before_the_engine(tiny_llm):
    with pytest.raises(ValueError, match="not valid Unicode"):
        tiny_llm.generate(["ok", "bad \ud800 surrogate"])
    with pytest.raises(ValueError, match="stop_token_ids .* outside the vocabulary"):
        tiny_llm.generate(["ok"], SamplingParams(stop_token_ids=[10**9]))
    with pytest.raises(ValueError, match="request_id must be a new string"):
        tiny_llm.add_request("ok", request_id=3)
    assert not tiny_llm.has_unfinished_requests()
