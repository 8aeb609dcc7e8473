"""vLLM's /tokenize and /detokenize on a real server: a text prompt and a chat (through the model's template) give
the tokenizer's own ids, count and token strings; ids come back as the tokenizer's text; bad input is a 400 that
says why; a client's chat template needs the operator's trust, as for chat completions."""
import httpx
import pytest

from tests.serving.test_serve import KEY, server  # noqa: F401  (the module's server fixture)

pytestmark = pytest.mark.spawn
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there, café ✓"}]


def post(port: int, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60)


def test_tokenize_and_detokenize_equal_the_tokenizer(server, tiny_llm):
    tok = tiny_llm.get_tokenizer()
    text = " The quick brown fox, naïve café 日本"
    r = post(server, "/tokenize", {"model": "tiny", "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    want = tok.encode(text)
    assert r.json() == {"count": len(want), "max_model_len": 512, "tokens": want,
                        "token_strs": tok.convert_ids_to_tokens(want)}
    r = post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False) and r.json()["token_strs"] is None
    chat = post(server, "/tokenize", {"messages": CHAT})
    rendered = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat.json()["tokens"] == tok.encode(rendered, add_special_tokens=False)
    bare = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert bare != chat.json()["tokens"]
    back = post(server, "/detokenize", {"model": "tiny", "tokens": want})
    assert back.status_code == 200 and back.json() == {"prompt": tok.decode(want)}


@pytest.mark.parametrize("path,body,words", [
    ("/tokenize", {"prompt": 7}, ["prompt"]),
    ("/tokenize", {"prompt": "x", "bogus": 1}, ["bogus"]),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, ["role"]),
    ("/tokenize", {"messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 'x' }}"}},
     ["--trust-request-chat-template"]),
    ("/tokenize", {"model": "gpt-4", "prompt": "x"}, ["does not exist"]),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, ["outside the vocabulary"]),
    ("/detokenize", {"tokens": [1, True]}, ["tokens"]),
])
def test_bad_tokenize_requests_are_answered_with_why(server, path, body, words):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    assert post(server, "/tokenize", {"prompt": "still serving"}).status_code == 200
