"""A request resumed on another engine (engine/resume.py): given its prompt, its parameters and what each
completion generated so far, a second engine goes on where the first stopped. Under batch_invariant the tokens,
seeded sampling included, are those of a run that never moved; the text sent goes on where the client's stopped;
n > 1 requests resume their unfinished completions; bad resume states are refused before anything is queued."""
import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.engine.resume import ResumedChoice
from nanovllm_tp.sampling_params import RequestOutputKind

PROMPT = "Once upon a time there"


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    """Two engines of the same model, as two replicas: the first runs requests undisturbed, the second resumes."""
    knobs = {"max_model_len": 512, "kv_cache_memory": 64 << 20, "kvcache_block_size": 16, "batch_invariant": True}
    first, second = LLM(tiny_model_dir, **knobs), LLM(tiny_model_dir, **knobs)
    yield first, second
    first.close()
    second.close()


def run_deltas(llm: LLM, rid: str, prompt, params: SamplingParams, resume=None) -> dict[int, dict]:
    """Step a request to its end; per completion index: its texts and token ids as the delta outputs gave them,
    and how many outputs carried its finish."""
    llm.add_requests([prompt], params, request_ids=[rid], resume=resume)
    got: dict[int, dict] = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            for c in out.outputs:
                g = got.setdefault(c.index, {"text": "", "ids": [], "finishes": 0})
                g["text"] += c.text
                g["ids"] += c.token_ids
                g["finishes"] += c.finish_reason is not None
    return got


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.9, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_a_resumed_request_goes_on_with_the_tokens_of_an_undisturbed_run(engines, sampling):
    first, second = engines
    params = SamplingParams(n=3, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA, **sampling)
    whole = run_deltas(first, f"whole-{sampling['temperature']}", PROMPT, params)
    assert sorted(whole) == [0, 1, 2]
    cut = {0: 11, 2: 25}                   # completion 1 finished before the move: it is not resumed
    resume = [[ResumedChoice(i, whole[i]["ids"][:k], len(second.tokenizer.decode(whole[i]["ids"][:k]))) for i, k in
               cut.items()]]
    rest = run_deltas(second, f"rest-{sampling['temperature']}", PROMPT, params, resume)
    assert sorted(rest) == [0, 2]
    for i, k in cut.items():
        assert whole[i]["ids"][:k] + rest[i]["ids"] == whole[i]["ids"]
        shown = len(second.tokenizer.decode(whole[i]["ids"][:k]))
        assert whole[i]["text"][:shown] + rest[i]["text"] == whole[i]["text"]
        assert rest[i]["finishes"] == 1


def test_text_held_back_before_the_move_is_sent_by_the_new_engine(engines):
    """The client saw fewer characters than the tokens hold (a stop string's hold-back): the new engine's first
    delta starts at the character the client stopped at."""
    first, second = engines
    params = SamplingParams(max_tokens=30, ignore_eos=True, stop=["zzzzqq"], output_kind=RequestOutputKind.DELTA)
    whole = run_deltas(first, "held", PROMPT, params)[0]
    ids = whole["ids"][:12]
    shown = len(second.tokenizer.decode(ids)) - 4
    rest = run_deltas(second, "held-rest", PROMPT, params, [[ResumedChoice(0, ids, shown)]])[0]
    assert whole["text"][:shown] + rest["text"] == whole["text"]
    assert whole["ids"][:12] + rest["ids"] == whole["ids"]


@pytest.mark.parametrize("resume, why", [
    ([[]], "non-empty"),
    ([[ResumedChoice(1, [5])]], "not one of the request's 1"),
    ([[ResumedChoice(0, [5]), ResumedChoice(0, [6])]], "repeated"),
    ([[ResumedChoice(0, [10 ** 9])]], "token ids below"),
    ([[ResumedChoice(0, [5] * 20)]], "nothing is left"),
    ([[ResumedChoice(0, [5], -1)]], "sent_chars"),
    ([[ResumedChoice(0, [5])], [ResumedChoice(0, [5])]], "one list of resumed completions per prompt"),
])
def test_bad_resume_states_are_refused_and_nothing_is_queued(engines, resume, why):
    _, second = engines
    params = SamplingParams(max_tokens=20, output_kind=RequestOutputKind.DELTA)
    with pytest.raises(ValueError, match=why):
        second.add_requests([PROMPT], params, resume=resume)
    assert not second.has_unfinished_requests()


def test_a_resumed_request_must_be_a_delta_one(engines):
    _, second = engines
    with pytest.raises(ValueError, match="DELTA"):
        second.add_requests([PROMPT], SamplingParams(max_tokens=20), resume=[[ResumedChoice(0, [5])]])


def test_a_resumed_structured_output_replays_its_grammar_and_stays_in_the_language(engines):
    """A regex-constrained completion moved after 6 tokens: the new engine's matcher replays them, the answer goes
    on equal to the undisturbed one and matches the pattern; tokens outside the language are refused."""
    import re

    from nanovllm_tp.sampling_params import StructuredOutputsParams
    first, second = engines
    pattern = r"(ab|cd|e ){6,12}z"
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=60, output_kind=RequestOutputKind.DELTA,
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    whole = run_deltas(first, "regex", PROMPT, params)[0]
    assert re.fullmatch(pattern, whole["text"])
    ids = whole["ids"][:6]
    rest = run_deltas(second, "regex-rest", PROMPT, params,
                      [[ResumedChoice(0, ids, len(second.tokenizer.decode(ids)))]])[0]
    assert ids + rest["ids"] == whole["ids"]
    outside = second.tokenizer.encode("zzzz", add_special_tokens=False)
    with pytest.raises(ValueError, match="resumed completion 0"):
        second.add_requests([PROMPT], params, resume=[[ResumedChoice(0, outside)]])
    assert not second.has_unfinished_requests()
