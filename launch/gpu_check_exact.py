"""gpu_check's exactness parts ("exact" at TP=1, "tp2" at TP=2): the tiny checkpoint's greedy tokens and
first-position logprobs against transformers fp32 on the CPU, one engine variant a row (dtype, block size, graphs
or eager, prefix-cache hits, chunked prefill, preemption), each checked against what LLM.stats() says it did."""
from __future__ import annotations

from nanovllm_tp.bench import common as bc
from nanovllm_tp.launch.gpu_check_rows import Row, Sizes, compare_tokens, greedy

HALF_LOGPROB_TOL, FP32_LOGPROB_TOL = 0.25, 1e-2     # |engine - reference| / std(reference), first position
BASE = dict(max_model_len=512, max_num_seqs=16, kvcache_block_size=16, kv_cache_memory=256 << 20)
TIGHT_KV = 41 * (32 << 10)    # 40 tiny fp32 blocks of 16 (+ null block): one 512-token sequence, never the batch
# check, dtype, LLM arguments over BASE, what LLM.stats() must show afterwards
VARIANTS = [("fp32, block 16, graphs", "float32", {}, "graphs"),
            ("fp32, enforce_eager", "float32", {"enforce_eager": True}, "eager"),
            ("fp32, prefix-cache hits", "float32", {}, "hits"),
            ("fp32, chunked prefill", "float32", {"max_num_batched_tokens": 64}, ""),
            ("fp32, preemption", "float32", {"kv_cache_memory": TIGHT_KV}, "preemptions"),
            ("bf16, default block", "bfloat16", {"kvcache_block_size": None}, "graphs"),
            ("bf16, block 16", "bfloat16", {}, "graphs"),
            ("fp16, block 128", "float16", {"kvcache_block_size": 128}, "graphs")]


def check_variant(part: str, model: str, device: str, ref, variant, tp: int) -> Row:
    """One engine against the reference: tokens, first-position logprobs (max |diff| over the engine's top 5,
    in units of the reference's std over the vocabulary) and what LLM.stats() says it did."""
    from nanovllm_tp import LLM
    (check, dtype, kwargs, expect), (prompts, lens, want, want_lp) = variant, ref
    if dtype == "float16" and device == "cpu":
        return Row(part, check, "float16 runs on CUDA only", "SKIP")
    try:
        llm = LLM(model, tensor_parallel_size=tp, dtype=dtype, device=device, **{**BASE, **kwargs})
        try:
            for _ in range(2 if expect == "hits" else 1):      # the second pass finds the prompts cached
                tokens, logprobs = greedy(llm, prompts, lens, logprobs=5)
            stats = llm.stats()
        finally:
            llm.close()
    except Exception as exc:        # one broken row must not hide the others
        return Row(part, check, f"{type(exc).__name__}: {exc}"[:300], "FAIL")
    half = dtype != "float32"
    status, summary = compare_tokens(tokens, want, 1 if half else None)
    err = max(abs(lp.logprob - float(w[t])) / float(w.std()) for pos, w in zip(logprobs, want_lp)
              for t, lp in pos[0].items())
    graphs = stats["cuda_graph_batch_sizes"]
    shown = {"graphs": bool(graphs) or device == "cpu", "eager": graphs is None, "": True,
             "hits": stats["prefix_cache_hit_tokens"] > 0, "preemptions": stats["num_preemptions"] > 0}
    if err > (HALF_LOGPROB_TOL if half else FP32_LOGPROB_TOL) or not shown[expect]:
        status = "FAIL"
    return Row(part, check, f"{summary}; logprob err {err:.1e}; {stats['attention_backend']} block "
                            f"{stats['kv_block_size']}, graphs {graphs}, {stats['num_preemptions']} preemptions, "
                            f"{stats['prefix_cache_hit_tokens']} prefix-cache hit tokens", status)


def part_exact(sizes: Sizes, device: str, add, part: str) -> None:
    """The exactness rows ("exact" at TP=1, "tp2" at TP=2) against transformers fp32 on the CPU: prompts, output
    lengths, its greedy tokens and its log-softmax over the vocabulary at each prompt's first generated position."""
    import torch
    from transformers import AutoModelForCausalLM

    from nanovllm_tp.bench.hf import hf_greedy
    from nanovllm_tp.launch.make_tiny import ensure_tiny
    if part == "tp2" and device == "cuda" and torch.cuda.device_count() < 2:
        return add(Row(part, "tensor_parallel_size=2", f"needs 2 GPUs, found {torch.cuda.device_count()}", "SKIP"))
    model = str(ensure_tiny("tiny"))
    w = bc.make_workload(sizes.prompts, sizes.prompt_len, sizes.output_len, 5, bc.model_vocab_size(model))
    prompts, hf = w.prompts(draw=1), AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        first = [hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1) for p in prompts]
    ref = prompts, w.output_lens, [hf_greedy(hf, p, m) for p, m in zip(prompts, w.output_lens)], first
    tp2 = [VARIANTS[0], VARIANTS[5]][:1 if device == "cpu" else 2]     # fp32 and bf16 graphs (fp32 on the CPU)
    for variant in (VARIANTS if part == "exact" else tp2):
        add(check_variant(part, model, device, ref, variant, 1 if part == "exact" else 2))
