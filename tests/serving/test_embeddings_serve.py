"""/v1/embeddings on a real server, through the official openai client (floats, base64) and raw HTTP: equal to
transformers' mean pooling of the model's hidden states (the model directory declares sentence-transformers mean
pooling and Matryoshka support), usage counted; bad bodies are a 400 that says why and the server keeps serving."""
import base64
import struct

import httpx
import pytest
import torch

from tests.embedding_helpers import cosine, hf_embedding, model_copy
from tests.serving.test_serve import KEY, client, metrics, served

pytestmark = pytest.mark.spawn
TEXTS = ["The quick brown fox", "Hello, my name is café ✓", "Once upon a time there was a small model"]


@pytest.fixture(scope="module")
def embed_server(tiny_model_dir, tmp_path_factory):
    d = model_copy(tiny_model_dir, str(tmp_path_factory.mktemp("st") / "mean"), "pooling_mode_mean_tokens",
                   config_extra={"is_matryoshka": True})
    with served(d, "--api-key", KEY, "--max-prompts-per-request", "8") as url:
        yield int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def hf_base(tiny_model_dir):
    from transformers import AutoModel
    return AutoModel.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def post(port: int, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/embeddings", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_openai_client_floats_and_base64(embed_server, hf_base, tiny_llm):
    tok = tiny_llm.get_tokenizer()
    ids = [tok.encode(t) for t in TEXTS]
    c = client(embed_server)
    plain = c.embeddings.create(model="tiny", input=TEXTS, encoding_format="float")
    packed = c.embeddings.create(model="tiny", input=TEXTS)      # the client asks for base64 and decodes it
    assert [d.index for d in plain.data] == [0, 1, 2] and plain.model == "tiny" and plain.object == "list"
    assert plain.usage.prompt_tokens == plain.usage.total_tokens == sum(map(len, ids))
    for i, want_ids in enumerate(ids):
        want = hf_embedding(hf_base, want_ids, "MEAN")
        assert cosine(plain.data[i].embedding, want) >= 0.9999
        assert plain.data[i].embedding == pytest.approx(packed.data[i].embedding, abs=1e-7)
    r = post(embed_server, {"input": TEXTS[0], "encoding_format": "base64", "user": "u1"})
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == plain.data[0].embedding


def test_token_ids_dimensions_and_vllm_fields(embed_server, hf_base):
    prompts = [[5, 9, 33, 2], [7] * 40]
    c = client(embed_server)
    one = c.embeddings.create(model="tiny", input=prompts[0], encoding_format="float")
    many = c.embeddings.create(model="tiny", input=prompts, dimensions=16, encoding_format="float")
    assert cosine(one.data[0].embedding, hf_embedding(hf_base, prompts[0], "MEAN")) >= 0.9999
    for d, p in zip(many.data, prompts):
        assert len(d.embedding) == 16
        assert cosine(d.embedding, hf_embedding(hf_base, p, "MEAN", dimensions=16)) >= 0.9999
    r = post(embed_server, {"input": [list(range(3, 700))], "truncate_prompt_tokens": 20, "normalize": False})
    assert r.status_code == 200, r.text
    got = r.json()["data"][0]["embedding"]
    want = hf_embedding(hf_base, list(range(3, 700))[-20:], "MEAN", normalize=False)
    assert torch.allclose(torch.tensor(got), want, rtol=1e-3, atol=1e-4) and r.json()["usage"]["prompt_tokens"] == 20


@pytest.mark.parametrize("body, status, words", [
    ({"input": []}, 400, ["input"]),
    ({"input": ""}, 400, ["empty"]),
    ({"input": "x", "bogus": 1}, 400, ["bogus"]),
    ({"input": "x", "encoding_format": "hex"}, 400, ["encoding_format"]),
    ({"input": "x", "dimensions": 0}, 400, ["dimensions"]),
    ({"input": "x", "dimensions": 10 ** 4}, 400, ["hidden size"]),
    ({"input": "x", "dimensions": 8.0}, 400, ["dimensions"]),
    ({"input": [[1, 10 ** 9]]}, 400, ["vocabulary"]),
    ({"input": [7] * 600}, 400, ["max_model_len"]),
    ({"input": ["x"] * 9}, 400, ["--max-prompts-per-request"]),
    ({"input": "x", "model": "gpt-4"}, 404, ["does not exist"]),
])
def test_bad_bodies_answered_with_why(embed_server, body, status, words):
    r = post(embed_server, body)
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert all(w in message for w in words), message
    assert post(embed_server, {"input": "still serving"}).status_code == 200


def test_generation_beside_embeddings_and_metrics(embed_server):
    """The same deployment generates too; /metrics counts embedding requests and their prompt tokens."""
    c = client(embed_server)
    out = c.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    before = metrics(embed_server)
    emb = c.embeddings.create(model="tiny", input=["fox", "a brown fox"], encoding_format="float")
    assert [len(d.embedding) for d in emb.data] == [128, 128]
    after = metrics(embed_server)
    tokens = 'prompt_tokens_total{model_name="tiny"}'
    ok = 'request_success_total{finished_reason="stop",model_name="tiny"}'
    assert after[tokens] - before[tokens] == emb.usage.prompt_tokens and after[ok] - before.get(ok, 0) == 2
