"""`serve --reasoning-parser qwen3` through the official `openai` client: a chat answer's think block comes back
as `reasoning_content` and the rest as `content`, streamed (as `delta.reasoning_content` then `delta.content`) or
not; without the parser the same answer is all content. The tiny model writes a think block because a regex
(structured outputs) makes it."""
import openai
import pytest

from nanovllm_tp import SamplingParams
from tests.serving.test_serve import KEY, server, start_server, wait_ready  # noqa: F401  (server: a fixture)

pytestmark = pytest.mark.spawn
CHAT = [{"role": "user", "content": "What is two and two?"}]
THINK = {"regex": "<think>[a-z ]{4,16}</think>[A-Za-z ]{3,12}"}


@pytest.fixture(scope="module")
def raw_answer(tiny_llm):
    out = tiny_llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=48, structured_outputs=THINK), use_tqdm=False)
    text = out[0].outputs[0].text
    assert text.startswith("<think>") and "</think>" in text
    return text


def test_the_think_block_is_reasoning_content_streamed_or_not(tiny_model_dir, raw_answer):
    reasoning, content = raw_answer[len("<think>"):raw_answer.index("</think>")], \
        raw_answer[raw_answer.index("</think>") + len("</think>"):]
    port, ctx = start_server(tiny_model_dir, "--reasoning-parser", "qwen3", "--api-key", KEY)
    with ctx as proc:
        wait_ready(port, proc)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=KEY, max_retries=0, timeout=120)
        kw = {"model": "tiny", "messages": CHAT, "temperature": 0, "max_tokens": 48,
              "extra_body": {"structured_outputs": THINK}}
        msg = c.chat.completions.create(**kw).choices[0].message
        assert (msg.model_extra["reasoning_content"], msg.content) == (reasoning, content)
        got_r = got_c = ""
        order = []
        for chunk in c.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                r, t = (ch.delta.model_extra or {}).get("reasoning_content"), ch.delta.content
                got_r += r or ""
                got_c += t or ""
                order += ["r"] * bool(r) + ["c"] * bool(t)
        assert (got_r, got_c) == (reasoning, content)
        assert order == sorted(order, reverse=True)        # every reasoning piece before the first content piece


def test_without_a_parser_the_answer_is_all_content(server, raw_answer):
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{server}/v1", api_key=KEY, max_retries=0, timeout=120)
    msg = c.chat.completions.create(model="tiny", messages=CHAT, temperature=0, max_tokens=48,
                                    extra_body={"structured_outputs": THINK}).choices[0].message
    assert msg.content == raw_answer and "reasoning_content" not in (msg.model_extra or {})
