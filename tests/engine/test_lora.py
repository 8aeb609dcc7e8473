"""Multi-LoRA against transformers + peft: a batch mixing two adapters and the base model equals peft's greedy
tokens for every row (TP 1 and TP 2), more adapters than max_loras in one generate (slots swapped), the prefix
cache with one prompt under two adapters and none, an adapter on SmolLM2; bad adapters refused before the engine
is touched."""
import json
import os
import shutil

import pytest

from nanovllm_tp import LLM, LoRARequest, SamplingParams
from tests.helpers import GGUF, GGUF_DIR, hf_greedy, mixed_prompts, smollm2

peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
KNOBS = dict(kvcache_block_size=16, kv_cache_memory=64 << 20, enable_lora=True)


@pytest.fixture(scope="module")
def base_hf(tiny_model_dir):
    """A transformers model of its own (make_lora wraps and unwraps it)."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapters(base_hf, tmp_path_factory):
    """Three adapters: every target at rank 8; q, v and down at rank 4 with rsLoRA; gate/up/o at rank 16."""
    from nanovllm_tp.launch.make_lora import make_lora
    root = tmp_path_factory.mktemp("loras")
    paths = [make_lora(base_hf, root / "a1", rank=8, alpha=16, seed=1),
             make_lora(base_hf, root / "a2", rank=4, alpha=8, seed=2, targets=("q_proj", "v_proj", "down_proj"),
                       use_rslora=True),
             make_lora(base_hf, root / "a3", rank=16, alpha=16, seed=3, targets=("gate_proj", "up_proj", "o_proj"))]
    return [LoRARequest(f"a{i + 1}", i + 1, p) for i, p in enumerate(paths)]


@pytest.fixture(scope="module")
def reference(base_hf):
    """(LoRARequest or None, prompt) -> peft's greedy tokens, computed once each."""
    from peft import PeftModel
    done = {}

    def get(lora, prompt):
        key = (lora and lora.lora_int_id, tuple(prompt))
        if key not in done:
            if lora is None:
                done[key] = hf_greedy(base_hf, prompt, TOKENS)
            else:
                model = PeftModel.from_pretrained(base_hf, lora.lora_path).eval()
                try:
                    done[key] = hf_greedy(model, prompt, TOKENS)
                finally:
                    model.unload()
        return done[key]
    return get


@pytest.fixture(scope="module")
def prompts(base_hf):
    return mixed_prompts(base_hf.config.vocab_size, lengths=(5, 17, 40, 23, 9), seed=3)


def check_rows(outputs, loras, prompts, reference):
    for out, lora, prompt in zip(outputs, loras, prompts):
        assert list(out.outputs[0].token_ids) == reference(lora, prompt), (lora, len(prompt))


def test_mixed_batch_matches_peft(tiny_model_dir, adapters, reference, prompts):
    a1, a2, _ = adapters
    loras = [a1, a2, None, a2, a1]
    with LLM(tiny_model_dir, max_loras=2, **KNOBS) as llm:
        check_rows(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras), loras, prompts, reference)
        assert llm.engine.scheduler.lora_slots.num_loads == 2
        fused = llm.engine.runner.model.model.fused      # its decode steps ran through csrc/decoder.c
        assert fused is None or fused.lora_steps >= TOKENS - 1
        # one LoRARequest for every prompt, and add_request / step
        check_rows(llm.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=a2), [a2, a2], prompts, reference)
        llm.add_request(prompts[2], GREEDY, request_id="x", lora_request=a1)
        done = {}
        while llm.has_unfinished_requests():
            done.update((o.request_id, o) for o in llm.step() if o.finished)
        check_rows([done["x"]], [a1], [prompts[2]], reference)
        # n > 1: the siblings start from the first one's prompt KV, under its adapter
        pair = llm.generate(prompts[3:4], SamplingParams(temperature=0, n=2, max_tokens=TOKENS, ignore_eos=True),
                            use_tqdm=False, lora_request=a2)[0]
        assert [list(c.token_ids) for c in pair.outputs] == [reference(a2, prompts[3])] * 2
    # the adapters change the tokens (else the test would prove nothing)
    for lora in (a1, a2):
        assert reference(lora, prompts[0]) != reference(None, prompts[0])


def test_bf16_adapters_match_peft_with_adapters_rounded_to_bf16(tiny_model_dir, base_hf, adapters, prompts):
    """lora_dtype="bfloat16" under the fp32 model: the slot tables hold each adapter rounded to bf16 (B with its
    scale, a power of two here, folded in) and every sum stays fp32, so the tokens are peft's with lora_A and lora_B
    rounded to bf16 first (not peft's own fp32 adapters: the rounding may change a token)."""
    import torch
    from peft import PeftModel
    a1, a2, _ = adapters
    loras = [a1, None, a2, a1]

    def rounded_peft(lora, prompt):
        if lora is None:
            return hf_greedy(base_hf, prompt, TOKENS)
        model = PeftModel.from_pretrained(base_hf, lora.lora_path).eval()
        try:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if "lora_" in name:
                        param.copy_(param.bfloat16().float())
            return hf_greedy(model, prompt, TOKENS)
        finally:
            model.unload()
    with LLM(tiny_model_dir, max_loras=2, lora_dtype="bfloat16", **KNOBS) as llm:
        assert {layer.A.dtype for layer in llm.engine.runner.lora.layers} == {torch.bfloat16}
        outs = llm.generate(prompts[:4], GREEDY, use_tqdm=False, lora_request=loras)
    for out, lora, prompt in zip(outs, loras, prompts):
        assert list(out.outputs[0].token_ids) == rounded_peft(lora, prompt), lora


@pytest.mark.parametrize("pool", ["roomy", "preempting"])
def test_more_adapters_than_slots_swap_and_stay_exact(tiny_model_dir, adapters, reference, prompts, pool):
    """Fewer slots than adapters; with a pool of 6 blocks the running rows also preempt each other (a preempted row
    gives its slot back and takes one again, reloading its adapter if it was swapped out)."""
    loras = [adapters[0], adapters[1], None, adapters[2], adapters[0]]
    knobs = {**KNOBS, "max_loras": 1} if pool == "roomy" else \
        {**KNOBS, "max_loras": 2, "kv_cache_memory": 6 * 32768, "max_model_len": 64}
    with LLM(tiny_model_dir, **knobs) as llm:
        check_rows(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras), loras, prompts, reference)
        sched = llm.engine.scheduler
        assert sched.lora_slots.num_loads >= 3 and not any(sched.lora_slots.holders)
        assert sched.block_manager.usage() == 0
        assert (sched.num_preemptions > 0) == (pool == "preempting")


def test_prefix_cache_is_keyed_by_adapter(tiny_model_dir, adapters, reference, prompts):
    a1, a2, _ = adapters
    prompt = prompts[2]                                   # 40 tokens: two full blocks of 16
    with LLM(tiny_model_dir, max_loras=2, **KNOBS) as llm:
        bm = llm.engine.scheduler.block_manager
        for lora in (a1, a2, None):                      # one after the other: each finds the others' blocks cached
            check_rows(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora), [lora], [prompt], reference)
        assert bm.num_prefix_hit_tokens == 0
        check_rows(llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=a2), [a2], [prompt], reference)
        assert bm.num_prefix_hit_tokens == 32


def _copy_adapter(src: str, dst, **config) -> str:
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_config.json")
    with open(path) as f:
        data = json.load(f)
    with open(path, "w") as f:
        json.dump({**data, **config}, f)
    return str(dst)


def _renamed(src: str, dst, old: str, new: str) -> str:
    """A copy of an adapter whose tensor names have `old` replaced by `new` (an adapter of another model)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_model.safetensors")
    save_file({k.replace(old, new): v for k, v in load_file(path).items()}, path)
    return str(dst)


def _poisoned(src: str, dst, value: float) -> str:
    """A copy of an adapter with one weight of its first lora_B set to `value` (NaN, inf)."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_model.safetensors")
    tensors = load_file(path)
    name = next(k for k in sorted(tensors) if "lora_B" in k)
    tensors[name][0, 0] = value
    save_file(tensors, path)
    return str(dst)


def test_bad_lora_requests_are_refused(tiny_model_dir, tiny_llm, adapters, base_hf, tmp_path, prompts):
    from nanovllm_tp.launch.make_lora import make_lora
    a1 = adapters[0]
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        tiny_llm.generate(prompts[:1], GREEDY, lora_request=a1)
    with pytest.raises(ValueError, match="max_loras=2 needs enable_lora=True"):
        LLM(tiny_model_dir, max_loras=2)
    with pytest.raises(ValueError, match="lora_dtype=bfloat16 needs enable_lora=True"):
        LLM(tiny_model_dir, lora_dtype="bfloat16")
    with pytest.raises(ValueError, match="lora_dtype must be one of 'auto', 'bfloat16', 'float32', got 'float16'"):
        LLM(tiny_model_dir, lora_dtype="float16", enable_lora=True)
    with pytest.raises(ValueError, match="max_loras=9 exceeds max_num_seqs=8"):
        LLM(tiny_model_dir, max_loras=9, max_num_seqs=8, enable_lora=True)
    lm_head = make_lora(base_hf, tmp_path / "head", targets=("q_proj", "lm_head"))
    bad = {
        "no LoRA adapter there": LoRARequest("x", 10, str(tmp_path / "missing")),
        "rank 16, above max_lora_rank=8": adapters[2],
        "lm_head": LoRARequest("h", 11, lm_head),
        "'model.layers.9.[a-z_.]+', which the model does not have":
            LoRARequest("deep", 15, _renamed(a1.lora_path, tmp_path / "deep", "layers.0.", "layers.9.")),
        "DoRA": LoRARequest("d", 12, _copy_adapter(a1.lora_path, tmp_path / "dora", use_dora=True)),
        "modules_to_save": LoRARequest("m", 13, _copy_adapter(a1.lora_path, tmp_path / "mts",
                                                                modules_to_save=["lm_head"])),
        "bias='all'": LoRARequest("b", 14, _copy_adapter(a1.lora_path, tmp_path / "bias", bias="all")),
        "lora_int_id must be a positive int": LoRARequest("z", 0, a1.lora_path),
        "no LoRA adapter there": LoRARequest("e", 16, str(tmp_path)),                 # a directory, no adapter
        "holds NaN or infinite values":
            LoRARequest("nan", 17, _poisoned(a1.lora_path, tmp_path / "nan", float("nan"))),
        "NaN or infinite": LoRARequest("inf", 18, _poisoned(a1.lora_path, tmp_path / "inf", float("-inf"))),
        "target_modules names 'embed_tokens', which the engine cannot adapt":
            LoRARequest("emb", 19, _copy_adapter(a1.lora_path, tmp_path / "emb",
                                                 target_modules=["q_proj", "embed_tokens"])),
        "target_modules '.\\*' matches 'model.embed_tokens'":
            LoRARequest("re", 20, _copy_adapter(a1.lora_path, tmp_path / "re", target_modules=".*")),
        "'lora_magic' is not a LoRA setting this engine knows":
            LoRARequest("u", 21, _copy_adapter(a1.lora_path, tmp_path / "unknown", lora_magic={"scale": 2})),
        "activated LoRA": LoRARequest("al", 22, _copy_adapter(a1.lora_path, tmp_path / "alora",
                                                               alora_invocation_tokens=[1, 2])),
        "lora_name has 257 characters; at most 256": LoRARequest("n" * 257, 23, a1.lora_path),
        "is adapter 'a1'": LoRARequest("other", 1, adapters[1].lora_path),
        "got 2 lora_requests for 1 prompts": [a1, a1],
    }
    with LLM(tiny_model_dir, max_loras=2, max_lora_rank=8, **KNOBS) as llm:
        for message, lora in bad.items():
            with pytest.raises(ValueError, match=message):
                llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=lora if message != "is adapter 'a1'"
                             else [lora])
            if message == "lora_int_id must be a positive int":    # a1 itself is now known under id 1
                llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=a1)
        with pytest.raises(TypeError, match="must be a LoRARequest"):
            llm.add_request(prompts[0], GREEDY, lora_request={"lora_name": "a1"})
        with pytest.raises(TypeError, match="lora_name must be a non-empty string"):
            llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("", 5, a1.lora_path))
        assert not llm.engine.has_unfinished()
        out = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=a1)    # still serving
        assert len(out[0].outputs[0].token_ids) == TOKENS
        # peft's fields that do not change what the adapter computes, and a field a newer peft writes unset
        harmless = _copy_adapter(a1.lora_path, tmp_path / "harmless", lora_dropout=0.3, init_lora_weights="gaussian",
                                 layers_to_transform=None, exclude_modules=None, some_future_field=None)
        again = llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("h2", 30, harmless))
        assert again[0].outputs[0].token_ids == out[0].outputs[0].token_ids


@pytest.mark.spawn
@pytest.mark.slow
def test_tp2_mixed_batch_matches_peft(tiny_model_dir, adapters, reference, prompts):
    loras = [adapters[0], adapters[1], None, adapters[2], adapters[1]]
    with LLM(tiny_model_dir, tensor_parallel_size=2, max_loras=2, **KNOBS) as llm:
        check_rows(llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras), loras, prompts, reference)


@smollm2
@pytest.mark.slow
def test_smollm2_adapter_matches_peft(tmp_path):
    pytest.importorskip("gguf")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_lora import make_lora
    hf = AutoModelForCausalLM.from_pretrained(GGUF_DIR, gguf_file=os.path.basename(GGUF), dtype=torch.float32).eval()
    lora = LoRARequest("smol", 1, make_lora(hf, tmp_path / "smol", rank=16, alpha=32, seed=5, gain=0.5))
    tok_prompts = [[1, 504, 3458, 282, 4649, 314], [1, 1780, 253, 2495, 3658, 30]]
    with LLM(GGUF, dtype="float32", device="cpu", max_model_len=256, quantization="none", max_loras=1,
             **KNOBS) as llm:
        out = llm.generate(tok_prompts * 2, GREEDY, use_tqdm=False, lora_request=[lora, lora, None, None])
    model = PeftModel.from_pretrained(hf, lora.lora_path).eval()
    tuned = [hf_greedy(model, p, TOKENS) for p in tok_prompts]
    model.unload()
    base = [hf_greedy(hf, p, TOKENS) for p in tok_prompts]
    assert [list(o.outputs[0].token_ids) for o in out] == tuned + base
    assert tuned != base


def test_bench_lora_runs_and_reports_figures(tiny_model_dir, base_hf, tmp_path, capsys):
    from nanovllm_tp.bench import lora as bench_lora
    result = bench_lora.main(["--model", tiny_model_dir, "--num-requests", "3", "--num-adapters", "2", "--max-tokens",
                              "4", "--repeats", "1", "--lora-rank", "4", "--kv-cache-memory", str(32 << 20),
                              "--out", str(tmp_path / "lora.json"), "--quiet"])
    f = result["figures"]
    assert f["tokens"] == 12 and f["lora_tok_s"] > 0 and f["base_tok_s"] > 0
    assert f["ratio"] == pytest.approx(f["lora_tok_s"] / f["base_tok_s"])
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    widths = sum(m.in_features + m.out_features for name, m in base_hf.named_modules() if name.endswith(targets))
    assert f["adapter_mb_per_step"] == pytest.approx(2 * 4 * widths * 4 / 1e6)    # 2 adapters, rank 4, fp32
    assert "LoRA/base" in capsys.readouterr().out


def test_a_lora_request_moves_with_its_kv_and_its_adapter(tiny_model_dir, adapters, reference, prompts):
    """A LoRA request exported after a few steps and imported into another engine: the payload names its adapter,
    the importer takes a slot for it and adopts the KV (only the tokens after the move are computed there), and
    the tokens are peft's. Where every slot of the importer is held by another adapter's running request, the
    completion computes again (still peft's tokens); an importer without LoRA, or a resumed request of another
    adapter than the KV's, is refused by name."""
    from nanovllm_tp.engine.kv_transfer import export_request, import_request, kv_for_resume
    from nanovllm_tp.engine.resume import ResumedChoice
    a1, a2, _ = adapters
    prompt = prompts[2]
    want = reference(a1, prompt)
    with LLM(tiny_model_dir, max_loras=1, **KNOBS) as first, LLM(tiny_model_dir, max_loras=1, **KNOBS) as second:
        for held in (None, a2):
            rid = f"moved-{held is not None}"
            if held is not None:    # second's only slot held by a2 while the moved request arrives
                second.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                                   request_id="holder", lora_request=held)
                second.step()
            first.add_request(prompt, GREEDY, request_id=rid, lora_request=a1)
            got = []
            for _ in range(4):
                got += [t for o in first.step() if o.request_id == rid for t in o.outputs[0].token_ids[len(got):]]
            payload = export_request(first, rid)
            before = second.stats()
            import_request(second, payload)
            done = {}
            while second.has_unfinished_requests():
                for o in second.step():
                    if o.request_id == rid:
                        done.setdefault(rid, []).extend(o.outputs[0].token_ids)
            assert got + done[rid] == want, held
            after = second.stats()
            recomputed = (after["kv_transfer"]["completions_recomputed"]
                          - before["kv_transfer"]["completions_recomputed"])
            assert recomputed == (held is not None)
            if held is None:        # the prompt and the first tokens came with the KV
                assert after["kv_transfer"]["blocks_in"] > before["kv_transfer"]["blocks_in"]
        first.add_request(prompt, GREEDY, request_id="refused", lora_request=a1)
        first.step()
        payload = export_request(first, "refused")
        with pytest.raises(ValueError, match="lora"):
            kv_for_resume(second, payload, prompt, [ResumedChoice(0, [], 0)], a2.lora_int_id)
    with LLM(tiny_model_dir, **{**KNOBS, "enable_lora": False}) as plain:
        with pytest.raises(ValueError, match="(?i)lora"):
            import_request(plain, payload)
        assert "refused" not in plain._requests
