"""gpu_check's throughput part: a Qwen3-0.6B-shaped random checkpoint (the tiny preset in the dry run), CUDA
graphs against enforce_eager (tokens, then tok/s on nano-vllm's bench workload) and the engine against
transformers' continuous batching on the first requests."""
from __future__ import annotations

from nanovllm_tp.bench import common as bc
from nanovllm_tp.launch.gpu_check_rows import Row, Sizes, compare_tokens, greedy


def part_tput(sizes: Sizes, device: str, add, part: str) -> None:
    import torch

    from nanovllm_tp import LLM
    from nanovllm_tp.bench import engine as bench_engine, hf as bench_hf
    from nanovllm_tp.launch.make_tiny import ensure_tiny
    model = str(ensure_tiny(sizes.preset))
    vocab, dtype, k = bc.model_vocab_size(model), ("float32" if device == "cpu" else "bfloat16"), sizes.hf_requests
    w = bc.make_workload(sizes.requests, sizes.lens, sizes.lens, 0, vocab)
    sub = bc.Workload(w.prompt_lens[:k], w.output_lens[:k], w.seed, vocab)
    prompts, check = w.prompts(draw=1), w.prompts(draw=2)[:16]
    check_lens = [max(1, 2 * sizes.output_len[1] - 3 * i) for i in range(len(check))]   # decode batch shrinks
    extra = dict(kv_cache_memory=64 << 20, max_model_len=1024) if device == "cpu" else {}
    runs, tokens = {}, {}
    for mode in ("graphs", "eager"):
        llm = LLM(model, dtype=dtype, device=device, enforce_eager=mode == "eager", enable_prefix_caching=False,
                  **extra)
        try:
            stats = llm.stats()
            tokens[mode] = greedy(llm, check, check_lens)[0]
            bench_engine.warm_up_engine(llm, vocab, 0, 0.0)
            runs[mode] = run = bench_engine.run_engine(llm, w, prompts, 0.0)
            if mode == "graphs":        # the engine on the requests transformers runs too
                runs["subset"] = bench_engine.run_engine(llm, sub, prompts[:k], 0.0)
        finally:
            llm.close()
        add(Row(part, f"engine tok/s, {mode}", f"{run['tok_s']:,.0f} ({w.num_requests} requests, "
                f"{w.requested_output_tokens} tokens, {run['seconds']:.1f}s; {stats['attention_backend']} block "
                f"{stats['kv_block_size']}, graphs {stats['cuda_graph_batch_sizes']})", "INFO" if run["lengths_ok"]
                else "FAIL"))
    status, summary = compare_tokens(tokens["graphs"], tokens["eager"], None if dtype == "float32" else 8)
    add(Row(part, f"graphs vs eager tokens ({dtype})", summary, status))
    add(Row(part, "graph speed-up", f"{runs['graphs']['tok_s'] / runs['eager']['tok_s']:.2f}x", "INFO"))
    hf = bench_hf.HFRunner(model, getattr(torch, dtype), torch.device(device), 0.0, 0, 512 if device == "cpu" else 8192)
    hf.warm_up(vocab, ["cb"])
    cb, ours = hf.generate_cb(sub, prompts[:k]), runs["subset"]
    add(Row(part, "transformers CB tok/s", f"{cb['tok_s']:,.0f} ({hf.attn_implementation}) on the first {k} requests, "
            f"engine {ours['tok_s']:,.0f}: {ours['tok_s'] / cb['tok_s']:.2f}x", "INFO" if cb["lengths_ok"] else "FAIL"))
