"""The fused decode layers (models/fused_decode.py, csrc/decoder.c): greedy tokens against transformers with the
decode steps (and the steps of prompts up to 512 tokens) run there (its step count says they were), and its
results the modules' to the bit (tokens and logprobs of rows decoded together, at different lengths: fp32 and
bf16, dense and block-quantized and int8 weights, oneDNN-packed ones run between decoder.c's calls (forced, or
chosen for some row-count buckets), q/k norms, biases, a sliding window, int8 and fp8 KV caches; LoRA rows of
several adapters beside base rows); the plans of calls a step makes; the steps it leaves to the modules."""
import pathlib

import pytest
import torch

from nanovllm_tp import LLM, LoRARequest, SamplingParams
from nanovllm_tp.config.engine_config import ModelConfig
from nanovllm_tp.launch.make_tiny import make_tiny_arch
from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.kernel_choice import bucket
from nanovllm_tp.layers.packed_linear import ONEDNN
from nanovllm_tp.models.fused_decode import DOWN, GATE_UP, O, PIECES, QKV, _plan
from tests.helpers import alternate_kernel_tables, hf_greedy, kernel_cache, mixed_prompts

pytestmark = pytest.mark.kernel_paths     # run again by .ci/run under --packed-linear c+onednn

KV = dict(kvcache_block_size=16, kv_cache_memory=32 << 20)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = (1, 9, 40, 130)      # rows of different lengths (blocks, a window's edge) in one decode batch
needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None, reason="the C kernels do not build here")
# ten rows that finish at different steps: a decode step's rows fall from 10 through 7 and 4 and 2 to 1, so that
# one generate call runs steps of the buckets 9-16, 5-8, 2-4 and 1
BUCKET_LENGTHS = (1, 9, 40, 130, 3, 20, 7, 64, 12, 33)
BUCKET_TOKENS = (16, 3, 3, 6, 6, 6, 10, 10, 12, 3)
ROW_BUCKETS = {bucket(rows) for rows in (10, 7, 4, 2, 1)}
# and the step of the ten prompts (319 tokens): the cpu backend takes prompts of up to 512 tokens as decode rows,
# so that step runs fused too, one decode row per token
STEP_BUCKETS = ROW_BUCKETS | {bucket(sum(BUCKET_LENGTHS))}


def onednn_runs(dtype) -> bool:
    return cpu_kernels.load() is not None and ONEDNN.can_run(torch.zeros(1, 2, dtype=dtype))


def bucket_params(logprobs: int | None = 3) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in BUCKET_TOKENS]


def buckets_run(fused) -> set[int]:
    """The row-count buckets the fused layers described (one Table each: the steps they ran)."""
    return {key[3] for key, table in fused.tables.items() if table is not None}


def c_linears(table) -> int:
    """How many linear pieces of a Table's layers decoder.c runs (those inside its plan's ranges)."""
    return sum(p % PIECES in (QKV, O, GATE_UP, DOWN) for op in table.plan if isinstance(op, range) for p in op)


def fused_of(llm):
    return llm.engine.runner.model.model.fused


@pytest.fixture(scope="module")
def vocab(tiny_model_dir):
    return ModelConfig.from_pretrained(tiny_model_dir).vocab_size


@needs_kernels
def test_greedy_matches_transformers_through_the_fused_layers(tiny_llm, hf_model, vocab):
    """Qwen3's tiny model (q/k norms), four rows decoded together: every decode step runs fused."""
    fused = fused_of(tiny_llm)
    assert fused is not None and tiny_llm.engine.runner.describe().endswith(", decode layers fused")
    before = fused.steps
    prompts = mixed_prompts(vocab, lengths=LENGTHS, seed=5)
    outs = tiny_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert fused.steps - before >= GREEDY.max_tokens - 1
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, GREEDY.max_tokens)


@pytest.mark.skipif(not onednn_runs(torch.float32), reason="oneDNN does not pack fp32 weights here")
def test_greedy_matches_transformers_with_onednn_linears_between_the_c_calls(tiny_model_dir, hf_model, vocab):
    """packed_linear=onednn: every linear of every layer runs through oneDNN between decoder.c's calls, in steps of
    several row-count buckets, and greedy tokens are still transformers'."""
    prompts = mixed_prompts(vocab, lengths=BUCKET_LENGTHS, seed=3)
    with LLM(tiny_model_dir, packed_linear="onednn", **KV) as llm:
        outs = llm.generate(prompts, bucket_params(None), use_tqdm=False)
        fused = fused_of(llm)
        assert fused.caller_steps == fused.steps >= max(BUCKET_TOKENS) and buckets_run(fused) == STEP_BUCKETS
    for p, n, o in zip(prompts, BUCKET_TOKENS, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, n)


def tiny_gguf(tmp_path, tiny_model_dir, qtype: str) -> str:
    from tests.gguf_tiny import write_gguf
    hf = make_tiny_arch(tmp_path / "hf", "llama", tie_word_embeddings=True)
    return str(write_gguf(hf, pathlib.Path(tiny_model_dir), tmp_path / "tiny.gguf", arch="llama", qtype=qtype))


def tiny_arch(tmp_path, arch: str, **overrides) -> str:
    make_tiny_arch(tmp_path / arch, arch, **overrides)
    return str(tmp_path / arch)


CASES = {   # name -> (model maker, knobs)
    "qwen3-fp32": (lambda tmp, tiny: tiny, {}),
    "qwen3-bf16-c": (lambda tmp, tiny: tiny, {"dtype": "bfloat16", "packed_linear": "c"}),
    "qwen3-int8": (lambda tmp, tiny: tiny, {"dtype": "bfloat16", "quantization": "int8"}),
    "qwen2-bias": (lambda tmp, tiny: tiny_arch(tmp, "qwen2"), {}),
    "mistral-window": (lambda tmp, tiny: tiny_arch(tmp, "mistral", sliding_window=24), {}),
    "gguf-q4_1": (lambda tmp, tiny: tiny_gguf(tmp, tiny, "Q4_1"), {}),
    # quantized KV caches: the store (values and scales) and the decode's dequantizing read inside decoder.c
    "kv-int8-bf16": (lambda tmp, tiny: tiny, {"dtype": "bfloat16", "packed_linear": "c", "kv_cache_dtype": "int8"}),
    "kv-fp8_e4m3": (lambda tmp, tiny: tiny, {"kv_cache_dtype": "fp8_e4m3"}),
    "kv-fp8_e5m2-bf16": (lambda tmp, tiny: tiny, {"dtype": "bfloat16", "packed_linear": "c",
                                                  "kv_cache_dtype": "fp8_e5m2"}),
    "kv-int8-window": (lambda tmp, tiny: tiny_arch(tmp, "mistral", sliding_window=24), {"kv_cache_dtype": "int8"}),
}


@needs_kernels
@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_layers_are_the_modules_to_the_bit(case, tmp_path, tiny_model_dir, vocab):
    """The same engine knobs with fused_decode on and off: the same tokens and the same logprobs, exactly, for
    rows decoded together; only the fused engine ran steps fused."""
    make, knobs = CASES[case]
    model = make(tmp_path, tiny_model_dir)
    if case == "qwen3-int8" and 100 not in cpu_kernels.load().quant_types:
        pytest.skip("int8 weights need csrc/linear_q.c (AVX-512 VNNI)")
    if case == "gguf-q4_1" and 3 not in cpu_kernels.load().quant_types:
        pytest.skip("Q4_1 weights need csrc/linear_q.c (AVX-512 VNNI)")
    if knobs.get("dtype") == "bfloat16" and torch.bfloat16 not in cpu_kernels.load().linear_dtypes:
        pytest.skip("bf16 layers fuse through csrc/linear.c's bf16 kernel (AVX-512 BF16)")
    prompts = mixed_prompts(vocab, lengths=LENGTHS, seed=7)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    results = {}
    for on in (True, False):
        llm = LLM(model, fused_decode=on, **KV, **knobs)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            fused = fused_of(llm)
            assert (fused is not None and fused.steps >= params.max_tokens - 1) if on else fused is None
        finally:
            llm.close()
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results[True] == results[False]


def run_both(model, prompts, params, knobs, check) -> dict:
    """{fused_decode: [(tokens, logprobs) per prompt]}; check(fused) on the fused engine's FusedDecode."""
    results = {}
    for on in (True, False):
        with LLM(model, fused_decode=on, **KV, **knobs) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            if on:
                check(fused_of(llm))
            else:
                assert fused_of(llm) is None
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return results


ONEDNN_CASES = {   # name -> (model maker, knobs), every linear oneDNN's
    "qwen3-fp32": (lambda tmp, tiny: tiny, {"packed_linear": "onednn"}),
    "qwen3-bf16": (lambda tmp, tiny: tiny, {"dtype": "bfloat16", "packed_linear": "onednn"}),
    "kv-int8-bf16": (lambda tmp, tiny: tiny, {"dtype": "bfloat16", "packed_linear": "onednn",
                                              "kv_cache_dtype": "int8"}),
    "qwen2-bias": (lambda tmp, tiny: tiny_arch(tmp, "qwen2"), {"packed_linear": "onednn"}),
}


@needs_kernels
@pytest.mark.parametrize("case", sorted(ONEDNN_CASES))
def test_onednn_linears_run_fused_and_are_the_modules_to_the_bit(case, tmp_path, tiny_model_dir, vocab):
    """packed_linear=onednn: each step of rows in the buckets 1, 2-4, 5-8 and 9-16, and the prompts' step, runs
    fused, its linears through oneDNN between decoder.c's calls (q/k/v biases through oneDNN too), with the
    modules' tokens and logprobs exactly."""
    make, knobs = ONEDNN_CASES[case]
    if not onednn_runs(getattr(torch, knobs.get("dtype", "float32"))):
        pytest.skip("oneDNN does not pack weights of this dtype here")

    def check(fused):
        assert fused.caller_steps == fused.steps >= max(BUCKET_TOKENS) and buckets_run(fused) == STEP_BUCKETS

    prompts = mixed_prompts(vocab, lengths=BUCKET_LENGTHS, seed=7)
    results = run_both(make(tmp_path, tiny_model_dir), prompts, bucket_params(), knobs, check)
    assert results[True] == results[False]


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stagger", [False, True], ids=["by-bucket", "by-shape-and-bucket"])
def test_auto_tables_with_c_and_onednn_buckets_run_fused_and_are_the_modules(dtype, stagger, tmp_path,
                                                                             monkeypatch, tiny_model_dir, vocab):
    """packed_linear=auto with a cached table whose winners alternate between csrc/linear.c and oneDNN by bucket
    (by-bucket: every shape alike, so a bucket's steps are one decoder.c call or have every linear between calls;
    by-shape-and-bucket: the other way round on every other shape, so a layer's linears mix the two): steps of
    both kinds of bucket run fused, with the modules' tokens and logprobs exactly."""
    if not (onednn_runs(getattr(torch, dtype)) and getattr(torch, dtype) in cpu_kernels.load().linear_dtypes):
        pytest.skip("csrc/linear.c or oneDNN does not run weights of this dtype here")
    cache = kernel_cache(tmp_path, monkeypatch)
    knobs = {"dtype": dtype, "packed_linear": "auto"}
    with LLM(tiny_model_dir, **KV, **knobs):      # measures the table, written to the cache
        pass
    assert alternate_kernel_tables(cache, stagger)
    c_buckets = {b for b in ROW_BUCKETS if b % 2 == 0}       # "c" wins the even buckets ("1", "5-8")

    def check(fused):
        assert fused.steps >= max(BUCKET_TOKENS) and buckets_run(fused) == STEP_BUCKETS
        tables = {key[3]: table for key, table in fused.tables.items()}
        for b in ROW_BUCKETS:
            if stagger:      # every bucket's layers hold both kernels' linears
                assert tables[b].callers and c_linears(tables[b]) > 0
            elif b in c_buckets:     # all csrc/linear.c's: one call for every layer
                assert tables[b].plan == [range(len(fused.layers) * PIECES)]
            else:                    # all oneDNN's: each between two calls
                assert tables[b].callers and c_linears(tables[b]) == 0
        assert (fused.caller_steps == fused.steps) if stagger else (0 < fused.caller_steps < fused.steps)

    prompts = mixed_prompts(vocab, lengths=BUCKET_LENGTHS, seed=21)
    results = run_both(tiny_model_dir, prompts, bucket_params(), knobs, check)
    assert results[True] == results[False]


def test_a_step_plan_cuts_decoder_calls_at_the_callers_linears_and_the_all_reduces():
    """The plan of a two-layer table: one decoder_run range where C runs everything at one rank; a cut around each
    linear run between the calls (in its piece's place); a None (the all-reduce) after o and down at TP > 1."""
    end = 2 * PIECES
    assert _plan([{}, {}], reduce=False) == [range(0, end)]
    assert _plan([{}, {}], reduce=True) == [range(0, O + 1), None, range(O + 1, DOWN + 1), None,
                                            range(PIECES, PIECES + O + 1), None, range(PIECES + O + 1, end), None]
    qkv, gate_up, down = "qkv", "gate_up", "down"     # stand-ins for CallerLinears
    assert _plan([{QKV: qkv}, {GATE_UP: gate_up, DOWN: down}], reduce=False) == [
        range(0, QKV), qkv, range(QKV + 1, PIECES + GATE_UP), gate_up, range(PIECES + GATE_UP + 1, PIECES + DOWN),
        down]
    assert _plan([{}, {DOWN: down}], reduce=True)[-3:] == [range(PIECES + O + 1, PIECES + DOWN), down, None]


@needs_kernels
def test_steps_the_fused_layers_cannot_run_go_through_the_modules(tiny_model_dir, vocab):
    """The torch attention backend (its decode is not the C kernel decoder.c calls): the layers could run fused,
    its steps do not, and every request still finishes."""
    llm = LLM(tiny_model_dir, kv_cache_dtype="int8", attention_backend="torch", **KV)
    try:
        outs = llm.generate(mixed_prompts(vocab, lengths=(3, 20), seed=9), GREEDY, use_tqdm=False)
        assert fused_of(llm) is not None and fused_of(llm).steps == 0
    finally:
        llm.close()
    assert [len(o.outputs[0].token_ids) for o in outs] == [GREEDY.max_tokens] * 2


@needs_kernels
def test_speculative_verify_steps_run_fused_and_match_transformers(tiny_model_dir, hf_model):
    """n-gram speculation: its verify steps (rows of 1 + k tokens over their KV) run fused, one decode row per
    token, and greedy output is still transformers'."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(tiny_model_dir, speculative_config=ngram, **KV)
    try:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(t) for t in ("Hello, world! Hello, world! Hello, world!", "def main():")]
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert fused_of(llm).verify_steps > 0 and llm.stats()["num_accepted_tokens"] > 0
    finally:
        llm.close()
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, GREEDY.max_tokens)


@needs_kernels
def test_speculative_verify_steps_with_an_int8_kv_cache_are_the_modules(tiny_model_dir):
    """int8 KV and n-gram speculation: verify steps run fused (each row's 1 + k tokens stored into the 8-bit cache by
    decoder.c, then read as decode rows) with the tokens and logprobs of the same engine through the modules."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    results = {}
    for on in (True, False):
        with LLM(tiny_model_dir, speculative_config=ngram, kv_cache_dtype="int8", fused_decode=on, **KV) as llm:
            tok = llm.get_tokenizer()
            prompts = [tok.encode(t) for t in ("Hello, world! Hello, world! Hello, world!", "def main():")]
            outs = llm.generate(prompts, params, use_tqdm=False)
            fused = fused_of(llm)
            assert (fused.verify_steps > 0 and llm.stats()["num_accepted_tokens"] > 0) if on else fused is None
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results[True] == results[False]


def lora_model(tmp_path, tiny_model_dir, case: str) -> tuple[str, list]:
    """The model of a LoRA case and two adapters of it (rank 16 over every target; rank 4 over q, v and down),
    made by peft."""
    import torch
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_lora import make_lora
    model = tiny_gguf(tmp_path, tiny_model_dir, "Q4_1") if case.startswith("gguf") else tiny_model_dir
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf") if case.startswith("gguf") else model,
                                              dtype=torch.float32)
    paths = [make_lora(hf, tmp_path / "l1", rank=16, alpha=32, seed=1),
             make_lora(hf, tmp_path / "l2", rank=4, alpha=8, seed=2, targets=("q_proj", "v_proj", "down_proj"))]
    return model, [LoRARequest(f"l{i + 1}", i + 1, p) for i, p in enumerate(paths)]


LORA_CASES = {   # name -> knobs
    "fp32": {},
    "bf16": {"dtype": "bfloat16", "packed_linear": "c"},
    "onednn-fp32": {"packed_linear": "onednn"},      # LoRALayer.apply after each linear run between the calls
    "onednn-bf16": {"dtype": "bfloat16", "packed_linear": "onednn"},
    "fp32-bf16-adapters": {"lora_dtype": "bfloat16"},
    "gguf-q4_1-bf16-adapters": {"lora_dtype": "bfloat16"},
}


@needs_kernels
@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_steps_run_fused_and_are_the_modules_to_the_bit(case, tmp_path, tiny_model_dir, vocab):
    """Rows of two adapters (one shared by two rows) and base rows decoded together, fused_decode on and off: the
    same tokens and logprobs exactly, and the fused engine ran its LoRA decode steps fused."""
    pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    if case.startswith("gguf") and 3 not in cpu_kernels.load().quant_types:
        pytest.skip("Q4_1 weights need csrc/linear_q.c (AVX-512 VNNI)")
    if LORA_CASES[case].get("dtype") == "bfloat16" and torch.bfloat16 not in cpu_kernels.load().linear_dtypes:
        pytest.skip("bf16 layers fuse through csrc/linear.c's bf16 kernel (AVX-512 BF16)")
    model, (l1, l2) = lora_model(tmp_path, tiny_model_dir, case)
    loras = [l1, None, l2, l1]
    prompts = mixed_prompts(vocab, lengths=LENGTHS, seed=13)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    results = {}
    for on in (True, False):
        with LLM(model, fused_decode=on, enable_lora=True, max_loras=2, max_lora_rank=16, **KV,
                 **LORA_CASES[case]) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
            fused = fused_of(llm)
            assert (fused.lora_steps >= params.max_tokens - 1) if on else fused is None
        results[on] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert results[True] == results[False]
    with LLM(model, enable_lora=True, **KV, **LORA_CASES[case]) as llm:    # the adapters change the tokens
        base = llm.generate(prompts, params, use_tqdm=False)
    assert all(b.outputs[0].token_ids != r[0] for b, r, lora in zip(base, results[True], loras) if lora)


@needs_kernels
def test_speculative_verify_steps_with_lora_rows_run_fused(tmp_path, tiny_model_dir):
    """n-gram speculation with LoRA rows beside a base row: verify steps with adapted rows run fused, and the greedy
    tokens are plain decoding's through the modules (no speculation, fused_decode off)."""
    pytest.importorskip("peft", reason="peft is not installed (pip install peft)")
    model, (l1, l2) = lora_model(tmp_path, tiny_model_dir, "fp32")
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=16, **KV)
    loras = [l1, None, l2]
    with LLM(model, fused_decode=False, **lora) as llm:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(t) for t in ("Hello, world! Hello, world! Hello, world!", "def main():", "a b a b a b")]
        plain = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    with LLM(model, speculative_config=ngram, **lora) as llm:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        fused = fused_of(llm)
        # every fused step had adapted rows (they run to the end together), verify steps among them
        assert fused.verify_steps > 0 and fused.lora_steps == fused.steps and llm.stats()["num_accepted_tokens"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
