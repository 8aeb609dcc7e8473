"""What a streaming client sees before a stop string ends its request: at every output, in every output kind and
stream interval, the text received so far is a prefix of the final text, which is the tokenizer's decode of the
plain greedy tokens cut where the stop string starts. Stop strings straddle 2, 3 and 4 tokens, in ASCII text and in
text whose characters span several tokens (multi-byte UTF-8 under a byte-level vocabulary)."""
import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.engine.output_processor import Detokenizer
from nanovllm_tp.sampling_params import RequestOutputKind
from tests.engine.test_lifecycle import assert_all_blocks_free, run_steps
from tests.helpers import GGUF, mixed_prompts, smollm2

N = 32
UNICODE = "日本語の文章 — naïve café ✓ Ωμέγα 🎉 ß"
KINDS = [(RequestOutputKind.DELTA, 1), (RequestOutputKind.DELTA, 3), (RequestOutputKind.CUMULATIVE, 1),
         (RequestOutputKind.CUMULATIVE, 2), (RequestOutputKind.FINAL_ONLY, 1)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": N, "ignore_eos": True, **kw})


def char_ends(tok, ids: list[int]) -> list[int]:
    """ends[i]: characters of the decode of ids[:i] once it is whole (a prefix that ends inside a character
    counts up to that character's start)."""
    ends = []
    for i in range(len(ids) + 1):
        text = tok.decode(ids[:i], skip_special_tokens=True)
        ends.append(len(text.rstrip("\ufffd")))
    return ends


def straddling_stops(text: str, ends: list[int], span: int) -> list[tuple[str, int]]:
    """Stop strings (and where they start) from the last character of one token through the first character of
    the token span - 1 later, found nowhere earlier in the text; at most two, from different places."""
    found = []
    for j in range(2, len(ends) - span):
        if ends[j + 1] <= ends[j] or ends[j + span] <= ends[j + span - 1]:
            continue                             # a token that adds no whole character ends or starts it
        a, b = ends[j + 1] - 1, ends[j + span - 1] + 1
        stop = text[a:b]
        if len(stop) >= 2 and text.find(stop) == a and stop.strip() and (not found or a > found[-1][1] + 8):
            found.append((stop, a))
        if len(found) == 2:
            break
    return found


def received(outs, kind) -> list[str]:
    """The text a client holds after each output of a request."""
    texts, held = [], ""
    for o in outs:
        if not o.outputs:
            continue
        piece = o.outputs[0].text
        held = held + piece if kind == RequestOutputKind.DELTA else piece
        texts.append(held)
    return texts


def cases_of(llm, requests, max_stops: int) -> list[tuple]:
    """(prompt, greedy text, stop candidates) per prompt: the plain greedy text and stop strings found in it."""
    tok = llm.get_tokenizer()
    out = []
    for prompt in requests:
        base = llm.generate([prompt], greedy(), use_tqdm=False)[0].outputs[0]
        text = tok.decode(base.token_ids, skip_special_tokens=True)
        assert base.text == text
        ends = char_ends(tok, base.token_ids)
        stops = [s for span in (2, 3, 4) for s in straddling_stops(text, ends, span)][:max_stops]
        assert len(stops) >= 3, (text, stops)
        out.append((prompt, text, stops))
    return out


def check_streams(llm, cases, kind, interval, include) -> None:
    for prompt, text, stops in cases:
        for stop, at in stops:
            want = text[:at + len(stop)] if include else text[:at]
            params = greedy(stop=["\x00never\x00", stop], include_stop_str_in_output=include, output_kind=kind,
                            stream_interval=interval)
            rid = llm.add_request(prompt, params)
            outs = run_steps(llm)[rid]
            seen = received(outs, kind)
            assert seen[-1] == want and outs[-1].finished
            assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
            for i, held in enumerate(seen):
                assert want.startswith(held), f"output {i} showed {held!r}; the final text is {want!r}"
            if kind == RequestOutputKind.FINAL_ONLY:
                assert len(outs) == 1
    assert_all_blocks_free(llm)


@pytest.fixture(scope="module")
def tiny_cases(tiny_llm, hf_model):
    return cases_of(tiny_llm, mixed_prompts(hf_model.config.vocab_size, lengths=(9, 30), seed=11), 6)


@pytest.fixture(scope="module")
def smollm2_llm():
    llm = LLM(GGUF, kv_cache_memory=64 << 20, max_model_len=256)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def unicode_cases(smollm2_llm):
    """SmolLM2 copies a line of multi-byte characters (CJK, Greek, an emoji) that its byte-level vocabulary
    splits across tokens."""
    prompt = "\n".join([f"Line: {UNICODE}"] * 3) + "\nLine:"
    cases = cases_of(smollm2_llm, [prompt], 5)
    assert sum(ord(c) > 127 for c in cases[0][1]) > 10
    assert any(any(ord(c) > 127 for c in stop) for stop, _ in cases[0][2])
    return cases


INCLUDE = pytest.mark.parametrize("include", [False, True], ids=["cut", "included"])
EVERY_KIND = pytest.mark.parametrize("kind,interval", KINDS, ids=[f"{k.name.lower()}-{i}" for k, i in KINDS])


@EVERY_KIND
@INCLUDE
def test_no_client_ever_sees_text_the_final_output_lacks(tiny_llm, tiny_cases, kind, interval, include):
    check_streams(tiny_llm, tiny_cases, kind, interval, include)


@smollm2
@EVERY_KIND
@INCLUDE
def test_multi_byte_text_streams_only_what_the_final_output_holds(smollm2_llm, unicode_cases, kind, interval,
                                                                   include):
    check_streams(smollm2_llm, unicode_cases, kind, interval, include)


@pytest.mark.parametrize("case", ["completes-a-character", "after-a-broken-byte"])
def test_a_prompt_ending_inside_a_character_decodes_alike_every_way(tiny_llm, case):
    """A prompt of ids may end inside a UTF-8 character. Token by token through the tokenizers library, token by
    token here, and at once at the end, the completion's text is the same; a character the completion finishes
    is whole in it."""
    tok = tiny_llm.get_tokenizer()
    char = tok.encode("日", add_special_tokens=False)
    assert len(char) > 1                           # the tiny byte-level vocabulary splits it
    words = tok.encode(" the text goes on 日本", add_special_tokens=False)
    head = tok.encode("Say:", add_special_tokens=False)
    if case == "completes-a-character":
        prompt, completion, want_start = head + char[:1], char[1:] + words, "日 the text"
    else:                                          # a lone continuation byte: a replacement character
        prompt, completion, want_start = head + char[1:2], words, "\ufffd the text"
    texts = []
    for way in ("library", "window", "at-once"):
        d = Detokenizer(tok, prompt, skip_special_tokens=True)
        if way == "window":
            d.backend = None
        if way == "at-once":
            d.add(completion, final=True)
        else:
            for t in completion:
                d.add([t])
            d.add([], final=True)
        texts.append(d.text)
    assert texts[0].startswith(want_start) and texts[0].endswith("日本")
    assert texts[1] == texts[0] and texts[2] == texts[0]
