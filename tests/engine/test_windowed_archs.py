"""Gemma 2, Gemma 3 (text) and Phi-3 against transformers: tiny random checkpoints (make_tiny --arch) whose
windows (24 or 40 tokens) are shorter than the prompts, through chunked prefill with a first chunk longer than the
window, a prefix-cache hit, TP 1 and 2; each piece of an architecture is shown to change transformers' tokens, so
none can be dropped unseen; the configs they may carry that are not implemented are refused by name."""
import json

import pytest

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.config.engine_config import ModelConfig
from nanovllm_tp.launch.make_tiny import make_tiny_arch
from tests.helpers import greedy_then_prefix_hits, hf_greedy, mixed_prompts, shared_prefix_prompts

NEW = 40
GREEDY = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
# arch -> its layers' windows in make_tiny's checkpoint
WINDOWS = {"gemma2": (24, 0, 24), "gemma3_text": (24, 24, 0), "phi3": (40, 40, 40)}


@pytest.fixture(scope="module", params=sorted(WINDOWS))
def arch_model(request, tmp_path_factory):
    """(arch, model directory, transformers model, prompts, transformers' greedy tokens for each)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_arch(path, request.param)
    vocab = hf.config.vocab_size
    prompts = mixed_prompts(vocab, lengths=(3, 30, 90), seed=5) + \
        shared_prefix_prompts(vocab, prefix_len=50, tails=(4, 20), seed=6)
    return request.param, str(path), hf, prompts, [hf_greedy(hf, p, NEW) for p in prompts]


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=(pytest.mark.spawn, pytest.mark.slow))],
                         ids=["tp1", "tp2"])
def test_greedy_equals_transformers(arch_model, tp):
    arch, path, _, prompts, expected = arch_model
    llm = LLM(path, tensor_parallel_size=tp, kvcache_block_size=16, kv_cache_memory=8 << 20,
              max_num_batched_tokens=40)
    assert llm.config.model_config.layer_windows == WINDOWS[arch]
    first, again = greedy_then_prefix_hits(llm, prompts, GREEDY, repeat=1)
    assert first == expected and again == expected[-1:]


def _changed(hf, prompt, expected, owners, attr, value) -> bool:
    """Whether transformers' tokens change with `attr` of each of `owners` set to `value` (restored after)."""
    saved = [getattr(o, attr) for o in owners]
    for o in owners:
        setattr(o, attr, value)
    try:
        return hf_greedy(hf, prompt, NEW) != expected
    finally:
        for o, v in zip(owners, saved):
            setattr(o, attr, v)


def test_each_piece_changes_the_tokens(arch_model):
    arch, _, hf, prompts, expected = arch_model
    attention = [layer.self_attn for layer in hf.model.layers]
    assert _changed(hf, prompts[2], expected[2], [hf.config], "sliding_window", 10 ** 6)
    if arch != "phi3":
        assert _changed(hf, prompts[2], expected[2], attention, "scaling", 32 ** -0.5)
    if arch == "gemma2":
        assert _changed(hf, prompts[2], expected[2], attention, "attn_logit_softcapping", None)


def test_logprobs_are_those_of_the_capped_logits(arch_model):
    # the final cap is monotone, so greedy tokens cannot show it: the logprobs do
    arch, path, hf, prompts, expected = arch_model
    if arch != "gemma2":
        pytest.skip("Gemma 3 caps nothing by default")
    import torch
    llm = LLM(path, kvcache_block_size=16, kv_cache_memory=8 << 20)
    out = llm.generate(prompts[1:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompts[1] + expected[1][:3]])).logits[0, len(prompts[1]) - 1:]
    want = torch.log_softmax(logits.double(), -1)
    cap = hf.config.final_logit_softcapping
    uncapped = torch.log_softmax(torch.atanh(logits.double() / cap) * cap, -1)
    for i, position in enumerate(out.logprobs):
        for token, logprob in position.items():
            assert logprob.logprob == pytest.approx(want[i, token].item(), abs=1e-4)
            assert abs(logprob.logprob - uncapped[i, token].item()) > 1e-2


@pytest.mark.parametrize("changes, message", [
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    (dict(hidden_activation="relu"), "hidden_act='relu'"),
    (dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4},
                           "full_attention": {"rope_type": "default", "rope_theta": 1e6}}), "sliding_attention"),
])
def test_unimplemented_gemma_configs_are_refused(changes, message, tmp_path):
    make_tiny_arch(tmp_path, "gemma3_text")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("changes, message", [
    (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 12, "long_factor": [2.0] * 12,
                        "original_max_position_embeddings": 256}), "longrope"),
])
def test_unimplemented_phi3_configs_are_refused(changes, message, tmp_path):
    make_tiny_arch(tmp_path, "phi3")
    raw = json.loads((tmp_path / "config.json").read_text())
    raw.pop("rope_parameters", None)
    raw.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_pretrained(str(tmp_path))
