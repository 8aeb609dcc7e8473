"""LoRA on a real server: `--enable-lora --lora-modules` (NAME=PATH and vLLM's JSON form), the adapter chosen by the
request's model field through the official openai client (greedy text equal to transformers + peft), adapters in
/v1/models, an unknown model's 404, and /v1/load_lora_adapter / /v1/unload_lora_adapter: lora_path held to the
operator's rules (absolute, or under --lora-root; no symbolic link out; one message for every path that gives no
adapter), adapters with NaN weights refused, and no NaN logprob in any JSON even from an adapter gone bad."""
import json
import os
import shutil

import httpx
import openai
import pytest

from tests.helpers import hf_greedy
from tests.engine.test_lora import _poisoned
from tests.serving.test_serve import served

pytestmark = pytest.mark.spawn
peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
PROMPT = [5, 17, 300, 42, 9, 77, 1000, 3]
TOKENS = 8


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """name -> (path, the greedy text transformers + peft give for PROMPT); "tiny" is the base model."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from nanovllm_tp.launch.make_lora import make_lora
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    root = tmp_path_factory.mktemp("served-loras")
    made = {"tiny": (None, tok.decode(hf_greedy(hf, PROMPT, TOKENS)))}
    for i, name in enumerate(("a1", "a2", "a3")):
        path = make_lora(hf, root / name, rank=4 * (i + 1), alpha=16, seed=10 + i)
        model = PeftModel.from_pretrained(hf, path).eval()
        made[name] = (path, tok.decode(hf_greedy(model, PROMPT, TOKENS)))
        model.unload()
    assert len({text for _, text in made.values()}) == 4        # each adapter changes the text
    return made


@pytest.fixture(scope="module")
def server(tiny_model_dir, adapters):
    a2 = json.dumps({"name": "a2", "path": adapters["a2"][0]})
    with served(tiny_model_dir, "--enable-lora", "--max-loras", "2", "--lora-modules",
                f"a1={adapters['a1'][0]}", a2, "--allow-runtime-lora-updating") as url:
        yield url


def complete(client, model: str):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_openai_client_selects_adapters_by_model(server, adapters):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    models = {m.id: m for m in client.models.list().data}
    assert set(models) == {"tiny", "a1", "a2"}
    assert models["a1"].parent == "tiny" and models["a1"].root == adapters["a1"][0]
    for name in ("a1", "tiny", "a2"):
        out = complete(client, name)
        assert out.model == name and out.choices[0].text == adapters[name][1], name
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        complete(client, "nope")


def test_load_and_unload_adapters(server, adapters):
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")

    def post(path, body):
        return httpx.post(f"{server}/v1/{path}", json=body, timeout=60)

    bad = post("load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent/adapter"})
    assert bad.status_code == 400 and "no LoRA adapter there" in bad.json()["error"]["message"]
    assert post("load_lora_adapter", {"lora_name": "a3"}).status_code == 400
    r = post("load_lora_adapter", {"lora_name": "a3", "lora_path": adapters["a3"][0]})
    assert r.status_code == 200, r.text
    assert post("load_lora_adapter", {"lora_name": "a3", "lora_path": adapters["a3"][0]}).status_code == 400
    assert {m.id for m in client.models.list().data} == {"tiny", "a1", "a2", "a3"}
    chat = client.chat.completions.create(model="a3", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.model == "a3"
    assert complete(client, "a3").choices[0].text == adapters["a3"][1]
    assert post("unload_lora_adapter", {"lora_name": "a3"}).status_code == 200
    assert post("unload_lora_adapter", {"lora_name": "a3"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        complete(client, "a3")
    assert complete(client, "a1").choices[0].text == adapters["a1"][1]     # the others still served


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/{path}", json=body, timeout=60)


def test_adapters_with_non_finite_weights_are_refused_at_load(server, adapters, tmp_path):
    for value in (float("nan"), float("inf")):
        path = _poisoned(adapters["a1"][0], tmp_path / f"bad{value}", value)
        r = _post(server, "load_lora_adapter", {"lora_name": "bad", "lora_path": path})
        assert r.status_code == 400 and "NaN or infinite" in r.json()["error"]["message"], r.text
    client = openai.OpenAI(base_url=server + "/v1", api_key="none")
    assert complete(client, "a1").choices[0].text == adapters["a1"][1]


def _strict(text: str):
    """JSON as the standard has it: NaN and Infinity are not numbers."""
    def refuse(constant):
        raise AssertionError(f"{constant} in a JSON answer")
    return json.loads(text, parse_constant=refuse)


def test_no_logprob_reaches_json_as_nan(server, adapters, tmp_path):
    """An adapter that passed its check and then went bad on disk (rewritten with a NaN before its first use):
    every logprob it yields is null, in completions and chat, streamed or not; never a 500, never a bare NaN."""
    path = shutil.copytree(adapters["a2"][0], tmp_path / "later")
    assert _post(server, "load_lora_adapter", {"lora_name": "later", "lora_path": str(path)}).status_code == 200
    shutil.rmtree(path)
    _poisoned(adapters["a2"][0], path, float("nan"))
    url = server + "/v1"
    cmpl = {"model": "later", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2, "echo": True}
    chat = {"model": "later", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 2}
    try:
        r = httpx.post(url + "/completions", json=cmpl, timeout=60)
        assert r.status_code == 200, r.text
        lp = _strict(r.text)["choices"][0]["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["token_logprobs"][-1] is None   # no prompt logprob; NaN
        r = httpx.post(url + "/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert _strict(r.text)["choices"][0]["logprobs"]["content"][0]["logprob"] is None
        for route, body in (("/completions", cmpl), ("/chat/completions", chat)):
            with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=60) as r:
                events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and len(events) >= 2
            for e in events[:-1]:
                _strict(e)
    finally:
        assert _post(server, "unload_lora_adapter", {"lora_name": "later"}).status_code == 200


def test_lora_paths_follow_the_operators_rules(tiny_model_dir, adapters, tmp_path):
    """--lora-root: a relative lora_path starts there, nothing outside it is read (not by a path, not through a
    symbolic link), and every path that gives no adapter gets the same message, naming only what was sent. Without
    a root (the module's server) a relative path is refused without a word about the server's directories."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    shutil.copytree(adapters["a1"][0], root / "good")
    shutil.copytree(adapters["a2"][0], outside)
    os.symlink(outside, root / "escape")                            # a directory link out of the root
    (root / "half").mkdir()                                          # its weights a link out of the root
    shutil.copy(outside / "adapter_config.json", root / "half")
    os.symlink(outside / "adapter_model.safetensors", root / "half" / "adapter_model.safetensors")
    (root / "empty").mkdir()
    (root / "plain").write_text("not an adapter")
    with served(tiny_model_dir, "--enable-lora", "--allow-runtime-lora-updating", "--lora-root", str(root)) as url:
        r = _post(url, "load_lora_adapter", {"lora_name": "good", "lora_path": "good"})
        assert r.status_code == 200, r.text
        r = _post(url, "load_lora_adapter", {"lora_name": "good2", "lora_path": str(root / "good")})
        assert r.status_code == 200, r.text
        roots = {m["id"]: m["root"] for m in httpx.get(url + "/v1/models").json()["data"]}
        assert roots["good"] == "good"
        messages = set()
        for given in ("escape", "half", "empty", "plain", "missing", "../outside", str(outside),
                      str(root / "escape"), "good/../../outside", "/etc"):
            r = _post(url, "load_lora_adapter", {"lora_name": "x", "lora_path": given})
            assert r.status_code == 400, (given, r.text)
            message = r.json()["error"]["message"]
            assert str(tmp_path) not in message.replace(given, "") and os.getcwd() not in message.replace(given, "")
            messages.add(message.replace(repr(given), "PATH"))
        assert len(messages) == 1, messages
        r = _post(url, "load_lora_adapter", {"lora_name": "n" * 257, "lora_path": "good"})
        assert r.status_code == 400 and "at most 256" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        assert complete(client, "good").choices[0].text == adapters["a1"][1]


def test_without_a_root_lora_path_is_absolute_and_links_stay_inside(server, adapters, tmp_path):
    r = _post(server, "load_lora_adapter", {"lora_name": "rel", "lora_path": "a1"})
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "must be an absolute path" in message and os.getcwd() not in message
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(os.path.join(adapters["a1"][0], "adapter_config.json"), half)
    os.symlink(os.path.join(adapters["a1"][0], "adapter_model.safetensors"), half / "adapter_model.safetensors")
    r = _post(server, "load_lora_adapter", {"lora_name": "half", "lora_path": str(half)})
    assert r.status_code == 400 and "no LoRA adapter there" in r.json()["error"]["message"]
    os.symlink(adapters["a3"][0], tmp_path / "whole")                # a link to a whole adapter directory: fine
    r = _post(server, "load_lora_adapter", {"lora_name": "whole", "lora_path": str(tmp_path / "whole")})
    assert r.status_code == 200, r.text
    assert _post(server, "unload_lora_adapter", {"lora_name": "whole"}).status_code == 200
