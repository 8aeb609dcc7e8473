"""LoRA on a real server: `--enable-lora --lora-modules` (NAME=PATH and vLLM's JSON form), the adapter chosen by the
request's model field through the official openai client (greedy text equal to transformers + peft), adapters in
/v1/models, an unknown model's 404, and /v1/load_lora_adapter / /v1/unload_lora_adapter."""
import json

import httpx
import openai
import pytest

from tests.helpers import hf_greedy
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
    assert bad.status_code == 400 and "is not a directory" in bad.json()["error"]["message"]
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
