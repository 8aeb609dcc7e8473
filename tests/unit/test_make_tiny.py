import json
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything must load from the directory alone

from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from nanovllm_tp.launch import make_tiny as mt  # noqa: E402

FILES = ["config.json", "generation_config.json", "model.safetensors", "special_tokens_map.json",
         "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return mt.make_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_dir).eval()


def load_with_info(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    return model.eval()


def test_loads_offline_with_transformers(tiny_dir, tiny_model):
    assert sorted(p.name for p in tiny_dir.iterdir()) == FILES
    config = AutoConfig.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert config.model_type == "qwen3" and config.architectures == ["Qwen3ForCausalLM"]
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (128, 4, 2)
    assert config.tie_word_embeddings and config.rope_parameters["rope_theta"] == 1e6
    assert config.vocab_size == len(tokenizer) == 2003 and config.vocab_size % 2 == 1
    assert tokenizer.eos_token == "<|endoftext|>" and config.eos_token_id == tokenizer.eos_token_id
    assert tiny_model.dtype == torch.float32
    assert tiny_model.lm_head.weight.data_ptr() == tiny_model.model.embed_tokens.weight.data_ptr()
    load_with_info(tiny_dir)  # every tensor has the name transformers expects
    norm = tiny_model.model.norm.weight
    assert not torch.equal(norm, torch.ones_like(norm)) and (norm - 1).abs().max() < 0.5


def test_same_seed_same_bytes_other_seed_differs(tiny_dir, tmp_path):
    again = mt.make_tiny(tmp_path / "again")
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = mt.make_tiny(tmp_path / "other", seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()


def test_sharded_checkpoint_matches_unsharded(tiny_model, tmp_path):
    sharded = mt.make_tiny(tmp_path, num_shards=3)
    shard_files = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    assert shard_files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == set(shard_files)
    assert set(weight_map) == set(tiny_model.state_dict()) - {"lm_head.weight"}  # tied: not stored
    input_ids = torch.tensor([[5, 17, 400, 1999, 2002, 9]])
    with torch.no_grad():
        assert torch.equal(load_with_info(sharded)(input_ids).logits, tiny_model(input_ids).logits)
    with pytest.raises(ValueError):
        mt.make_tiny(tmp_path / "too_many", num_shards=1000)


def test_config_overrides_produce_matching_weights(tmp_path):
    path = mt.make_tiny(tmp_path, num_key_value_heads=1, tie_word_embeddings=False, attention_bias=True)
    model = load_with_info(path)
    assert model.config.num_key_value_heads == 1 and not model.config.tie_word_embeddings
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (32, 128)
    assert model.model.layers[0].self_attn.q_proj.bias is not None


def test_tokenizer_round_trip_and_chat_template(tiny_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    text = "Return a list of   names.\n\tTabs, ünïcode ✓ and 日本語 survive byte-level BPE."
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and len(ids) < len(text.encode())  # merges were learned
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert len(tokenizer.encode(token)) == 1 and tokenizer.encode(token)[0] >= 2000
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                      "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_margins_are_wide_and_output_varies(tiny_dir):
    margins, continuations = mt.greedy_margins(tiny_dir)
    margins = torch.tensor(margins)
    # Measured: median 1.58, p5 0.124 (see module docstring); thresholds leave headroom.
    assert margins.median() > 1.0 and margins.quantile(0.05) > 0.05
    assert all(len(set(tokens)) >= 8 for tokens in continuations)


def test_ensure_tiny_caches_and_survives_a_lost_race(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOVLLM_TP_CACHE", str(tmp_path))
    first = mt.ensure_tiny()
    assert first.parent == tmp_path and first.name.startswith("tiny-") and (first / "config.json").exists()
    assert mt.ensure_tiny() == first and list(tmp_path.iterdir()) == [first]

    # Another process finishes the same directory while we are still building ours.
    racer_cache = tmp_path / "racer"
    monkeypatch.setenv("NANOVLLM_TP_CACHE", str(racer_cache))
    real_make_tiny = mt.make_tiny

    def make_tiny_and_lose_race(out_dir, **kwargs):
        real_make_tiny(out_dir, **kwargs)
        real_make_tiny(racer_cache / first.name, **kwargs)

    monkeypatch.setattr(mt, "make_tiny", make_tiny_and_lose_race)
    assert mt.ensure_tiny() == racer_cache / first.name
    assert list(racer_cache.iterdir()) == [racer_cache / first.name]  # our temp dir was removed


def test_cli_writes_and_reports(tmp_path, capsys):
    mt.main([str(tmp_path), "--shards", "2", "--seed", "3"])
    printed = capsys.readouterr().out
    assert "model.safetensors.index.json" in printed and "model-00002-of-00002.safetensors" in printed


@pytest.mark.parametrize("arch", sorted(mt.ARCHS))
def test_other_architectures_from_the_cli(arch, tmp_path, capsys):
    mt.main([str(tmp_path / arch), "--arch", arch, "--seed", "3"])
    assert "model.safetensors" in capsys.readouterr().out
    config = AutoConfig.from_pretrained(tmp_path / arch)
    assert config.model_type == arch and config.vocab_size == len(AutoTokenizer.from_pretrained(tmp_path / arch))
    load_with_info(tmp_path / arch)
