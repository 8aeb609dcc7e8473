"""vLLM's serving flags on a real server and engine: --generation-config (the model's generation_config.json
sampling fields as the defaults of what a request leaves unset, on every generating route and in LLM.generate),
--tokenizer (a tokenizer from elsewhere than the model's folder), --chat-template (chat completions, responses
and /tokenize render with it), --max-logprobs (more is a 400 naming the flag, a ValueError offline),
--no-enable-auto-tool-choice (tool_choice "auto" refused as vLLM refuses it), and each bad value refused in one
line before the engine starts."""
import json
import os

import httpx
import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.launch import serve
from tests.serving.test_serve import KEY, start_server, wait_ready

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
CHAT = [{"role": "user", "content": "The quick brown fox"}]
DEFAULT_MAX = 6          # the test model's generation_config.json: max_new_tokens
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def model_without_tokenizer(src: str, dst, generation: dict) -> str:
    """A model folder of `src`'s weights and config (links) with no tokenizer files, and this generation config."""
    dst.mkdir()
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(src, name), dst / name)
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": 2000, **generation}))
    return str(dst)


@pytest.fixture(scope="module")
def flags_server(tiny_model_dir, tmp_path_factory):
    """A server of a model folder without a tokenizer (--tokenizer gives it the tiny one), whose generation
    config asks for greedy answers of DEFAULT_MAX tokens, with its own chat template, 3 logprobs at most and
    auto tool choice off."""
    tmp = tmp_path_factory.mktemp("flags")
    model = model_without_tokenizer(tiny_model_dir, tmp / "model", {"temperature": 0.0,
                                                                    "max_new_tokens": DEFAULT_MAX})
    (tmp / "chat.jinja").write_text(TEMPLATE)
    port, ctx = start_server(model, "--api-key", KEY, "--tokenizer", tiny_model_dir, "--chat-template",
                             str(tmp / "chat.jinja"), "--max-logprobs", "3", "--no-enable-auto-tool-choice")
    with ctx as proc:
        wait_ready(port, proc)
        yield port


def post(port: int, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json={"model": "tiny", **body},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def greedy(tiny_llm, max_tokens: int, chat: bool = False) -> str:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if chat:
        return tiny_llm.chat(CHAT, params, use_tqdm=False, chat_template=TEMPLATE)[0].outputs[0].text
    return tiny_llm.generate([CHAT[0]["content"]], params, use_tqdm=False)[0].outputs[0].text


@pytest.mark.spawn
def test_generation_config_defaults_what_a_request_leaves_unset(flags_server, tiny_llm):
    """No temperature, no max_tokens: the file's greedy DEFAULT_MAX tokens, twice the same, equal to offline
    greedy; what a request gives wins (its max_tokens, its temperature)."""
    body = {"prompt": CHAT[0]["content"], "ignore_eos": True}
    first, second = (post(flags_server, "/v1/completions", body).json() for _ in range(2))
    assert first["usage"]["completion_tokens"] == DEFAULT_MAX
    assert first["choices"][0]["text"] == second["choices"][0]["text"] == greedy(tiny_llm, DEFAULT_MAX)
    assert post(flags_server, "/v1/completions", {**body, "max_tokens": 2}).json()["usage"]["completion_tokens"] == 2
    sampled = {post(flags_server, "/v1/completions", {**body, "temperature": 1.0, "seed": s}).json()["choices"][0]
               ["text"] for s in range(4)}
    assert sampled - {first["choices"][0]["text"]}
    chat = post(flags_server, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True}).json()
    assert chat["usage"]["completion_tokens"] == DEFAULT_MAX
    assert chat["choices"][0]["message"]["content"] == greedy(tiny_llm, DEFAULT_MAX, chat=True)
    response = post(flags_server, "/v1/responses", {"input": CHAT[0]["content"], "ignore_eos": True}).json()
    assert response["usage"]["output_tokens"] == DEFAULT_MAX


@pytest.mark.spawn
def test_chat_template_and_tokenizer_flags_make_the_prompt(flags_server, tiny_llm):
    """/tokenize renders messages with --chat-template's template, in --tokenizer's ids (the model's folder has
    no tokenizer at all)."""
    tok = tiny_llm.get_tokenizer()
    rendered = tok.apply_chat_template(CHAT, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert rendered != tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    r = post(flags_server, "/tokenize", {"messages": CHAT})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tok.encode(rendered, add_special_tokens=False)
    r = post(flags_server, "/tokenize", {"prompt": "naïve café"})
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("naïve café"), r.text


@pytest.mark.spawn
def test_max_logprobs_and_auto_tool_choice_refusals_name_their_flags(flags_server):
    ok = post(flags_server, "/v1/completions", {"prompt": "x", "logprobs": 3, "max_tokens": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == 3, ok.text
    for path, body in (("/v1/completions", {"prompt": "x", "logprobs": 5}),
                       ("/v1/completions", {"prompt": "x", "logprobs": 4, "echo": True}),
                       ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 4})):
        r = post(flags_server, path, body)
        assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"], r.text
    r = post(flags_server, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER]})
    assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"], r.text
    r = post(flags_server, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER], "tool_choice": "none",
                                                    "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_llm_takes_the_engine_flags(tiny_model_dir, tmp_path):
    """LLM(...): the model's generation config as generate's defaults (none under generation_config="vllm"), a
    tokenizer from elsewhere, max_logprobs as a ValueError naming the knob."""
    model = model_without_tokenizer(tiny_model_dir, tmp_path / "model", {"temperature": 0.0, "max_new_tokens": 5})
    llm = LLM(model, tokenizer=tiny_model_dir, max_logprobs=2, kvcache_block_size=16, kv_cache_memory=16 << 20)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (0.0, 5)
        outs = [llm.generate(["Hello, my name is"], use_tqdm=False)[0].outputs[0] for _ in range(2)]
        assert outs[0].token_ids == outs[1].token_ids and len(outs[0].token_ids) <= 5 and outs[0].text
        assert llm.generate(["x"], SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False)[0].outputs[0].logprobs
        for name in ("logprobs", "prompt_logprobs"):
            with pytest.raises(ValueError, match=f"{name}=3 is more than this engine allows: max_logprobs=2"):
                llm.generate(["x"], SamplingParams(**{name: 3}), use_tqdm=False)
    finally:
        llm.close()
    plain = LLM(model, tokenizer=tiny_model_dir, generation_config="vllm", kvcache_block_size=16,
                kv_cache_memory=16 << 20)
    try:
        defaults = plain.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens) == (1.0, 16)
    finally:
        plain.close()


@pytest.mark.parametrize("flags,words", [
    (["--chat-template", "/nowhere/chat.jinja"], ["--chat-template '/nowhere/chat.jinja' reads as a file path"]),
    (["--chat-template", "{% if messages %}{{ x }"], ["--chat-template", "Jinja syntax error"]),
    (["--tool-call-parser", "mistral"], ["--tool-call-parser 'mistral' is not implemented", "hermes"]),
    (["--tool-call-parser", "hermes", "--no-enable-auto-tool-choice"], ["--no-enable-auto-tool-choice"]),
    (["--generation-config", "/nowhere"], ["generation_config '/nowhere' is not 'auto', 'vllm' or a directory"]),
    (["--tokenizer", "/nowhere/tok"], ["tokenizer '/nowhere/tok' is neither"]),
    (["--max-logprobs", "-2"], ["max_logprobs must be >= -1"]),
])
def test_bad_flag_values_are_one_line_before_the_engine(flags, words, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("GOMP_SPINCOUNT", serve.GOMP_SPINCOUNT)       # what serve would set, restored after
    with pytest.raises(SystemExit) as info:
        serve.main(["--model", tiny_model_dir, *flags])
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and err.startswith("serve: ") and "\n" not in err, err
    assert all(w in err for w in words), err
