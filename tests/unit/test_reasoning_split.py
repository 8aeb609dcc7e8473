"""The reasoning split (serving/reasoning.py) on whole answers, and streamed in every way a text can be cut: the
streamed pieces concatenate to the whole answer's reasoning and content, whatever the cuts."""
import random

import pytest

from nanovllm_tp.serving.reasoning import ThinkSplitter, split_reasoning

CASES = [   # (parser, answer, reasoning_content, content)
    ("qwen3", "<think>\nadd 2 and 2\n</think>\n\nIt is 4.", "\nadd 2 and 2\n", "\n\nIt is 4."),
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "It is 4.", None, "It is 4."),
    ("qwen3", "<think>cut short by max_tokens", "cut short by max_tokens", None),
    ("qwen3", "<think></think>", "", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "a <think>b</think> c", None, "a <think>b</think> c"),
    ("qwen3", "<think>x</thinker> y</think>z", "x</thinker> y", "z"),
    ("deepseek_r1", "so 4\n</think>\n\nIt is 4.", "so 4\n", "\n\nIt is 4."),
    ("deepseek_r1", "never closed", "never closed", None),
]


@pytest.mark.parametrize("parser,answer,reasoning,content", CASES)
def test_whole_answers_split_as_vllm_documents(parser, answer, reasoning, content):
    assert split_reasoning(parser, answer) == (reasoning, content)


@pytest.mark.parametrize("parser,answer,reasoning,content", CASES)
def test_streamed_pieces_concatenate_to_the_whole_split(parser, answer, reasoning, content):
    rng = random.Random(len(answer))
    for trial in range(60):
        cuts = sorted(rng.sample(range(1, len(answer)), min(len(answer) - 1, rng.randint(0, 6)))) if len(answer) > 1 \
            else []
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])] if trial else list(answer)
        s = ThinkSplitter.of(parser)
        got_r = got_c = ""
        for i, piece in enumerate(pieces):
            r, c = s.feed(piece, final=i == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
        assert (got_r, got_c) == (reasoning or "", content or ""), pieces


def test_nothing_of_a_tag_is_shown_before_it_is_known():
    s = ThinkSplitter.of("qwen3")
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>step one</th") == ("step one", "")
    assert s.feed("ink>The answer") == ("", "The answer")


def test_chat_template_kwargs_reach_the_template(tiny_model_dir):
    """What turns thinking off in Qwen3's template (`enable_thinking`) is a template variable like any other."""
    from transformers import AutoTokenizer

    from nanovllm_tp.entrypoints.prompts import render_chat
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    template = "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}" \
               "{{ messages[0]['content'] }}"
    chat = [{"role": "user", "content": "hi"}]
    assert render_chat(tok, chat, template, chat_template_kwargs={"enable_thinking": False}) == \
        "<think>\n\n</think>\n\nhi"
    assert render_chat(tok, chat, template) == "hi"
