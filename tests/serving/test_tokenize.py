"""vLLM's /tokenize and /detokenize on a real server: a text prompt and a chat (through the model's template) give
the tokenizer's own ids, count and token strings; ids come back as the tokenizer's text; bad input is a 400 that
says why, naming the field as the client wrote it; a prompt longer than the context is refused as generation refuses
it; a client's chat template needs the operator's trust, as for chat completions."""
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
    ("/tokenize", {"prompt": "word " * 600}, ["prompt 0 has 601 tokens", "at most 512"]),
    ("/tokenize", {"prompt": "x" * 100_000}, ["prompt 0 has at least"]),
    ("/tokenize", {"messages": [{"role": "user", "content": "word " * 600}]}, ["prompt 0 has", "at most 512"]),
    ("/detokenize", {"tokens": [5] * 513}, ["513 tokens", "max_model_len=512"]),
])
def test_bad_tokenize_requests_are_answered_with_why(server, path, body, words):
    r = post(server, path, body)
    assert r.status_code in (400, 404), r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    assert post(server, "/tokenize", {"prompt": "still serving"}).status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {"prompt": 7}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": 3}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     "messages.0.content.0.text"),
    ("/v1/completions", {"model": "tiny", "prompt": [[1, "a"]]}, "prompt.0.1"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": {"type": "function"}}, "tool_choice"),
    ("/v1/embeddings", {"model": "tiny", "input": [[1, "a"]]}, "input.0.1"),
])
def test_errors_name_the_field_as_the_client_wrote_it(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"].startswith(f"{param}: "), error
