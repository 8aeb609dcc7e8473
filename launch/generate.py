"""Print completions for one or more prompts.

    python -m nanovllm_tp.launch.generate --prompt "The quick brown fox"
    ./torchrun.sh 2 -m nanovllm_tp.launch.generate --tp 2 --model DIR --prompt "..." --prompt "..."

Without --model it uses the embedded tiny checkpoint (random weights, made offline on first use), so the
output is fluent nonsense: it shows the engine working, not a language model.
"""
import argparse

from nanovllm_tp import LLM, SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="Hugging Face model directory, .gguf file or directory holding one "
                        "(default: the embedded tiny checkpoint)")
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, help="KV cache block size")
    parser.add_argument("--attention-backend", default="auto",
                        help="auto, or a backend's name: torch, cpu (C decode kernel), torch-cuda, flash")
    parser.add_argument("--kv-cache-memory", type=int, help="KV cache bytes per rank")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", metavar="OUT.json", help="write a Chrome/Perfetto trace of every rank's steps "
                        "(open it in https://ui.perfetto.dev)")
    parser.add_argument("--trace-layers", action="store_true", help="with --trace: a span per decoder layer")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="report a running request's output every N new tokens (first and last at once); "
                             "larger N streams fewer, larger chunks for less CPU per token")


def build_llm(args) -> LLM:
    model = args.model
    if model is None:
        from nanovllm_tp.launch.make_tiny import ensure_tiny
        model = str(ensure_tiny())
    return LLM(model, tensor_parallel_size=args.tp, dtype=args.dtype, device=args.device,
               max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_num_batched_tokens=args.max_num_batched_tokens, kvcache_block_size=args.block_size,
               kv_cache_memory=args.kv_cache_memory, enforce_eager=args.enforce_eager,
               enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
               attention_backend=args.attention_backend, trace_path=args.trace, trace_layers=args.trace_layers,
               stream_interval=args.stream_interval)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--n", type=int, default=1, help="completions per prompt")
    parser.add_argument("--stop", action="append", help="a stop string (repeat for several)")
    parser.add_argument("--ignore-eos", action="store_true")
    args = parser.parse_args(argv)
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    llm = build_llm(args)
    prompts = args.prompt or ["The quick brown fox", "Return a list of"]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for out, prompt in zip(outputs, prompts):
        for completion in out.outputs:
            print(f"\nPrompt: {prompt!r}\nCompletion {completion.index} ({len(completion.token_ids)} tokens, "
                  f"{completion.finish_reason}): {completion.text!r}")
    llm.close()


if __name__ == "__main__":
    main()
