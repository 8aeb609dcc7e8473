"""Print completions for one or more prompts.

    python -m nanovllm_tp.launch.generate --prompt "The quick brown fox"
    ./torchrun.sh 2 -m nanovllm_tp.launch.generate --tp 2 --model DIR --prompt "..." --prompt "..."
    python -m nanovllm_tp.launch.generate --model HuggingFaceTB/SmolLM2-135M-Instruct --chat --prompt "Hi"

Without --model it uses the embedded tiny checkpoint (random weights, made offline on first use), so the
output is fluent nonsense: it shows the engine working, not a language model.
"""
import argparse
import sys

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.config.engine_config import EngineConfig, add_engine_args, engine_kwargs


def local_model(args) -> str:
    """The local path of a command's --model, resolved once per command and kept on `args` (args.model stays what
    the user typed, the name serve answers to): a Hugging Face hub id found in the cache or downloaded there
    (checkpoint/hub.py), before any rank starts; without --model, the tiny checkpoint. ValueError when the id
    cannot be had."""
    if getattr(args, "resolved_model", None) is None:
        if args.model is None:
            from nanovllm_tp.launch.make_tiny import ensure_tiny
            args.resolved_model = str(ensure_tiny())
        else:
            from nanovllm_tp.checkpoint.hub import resolve_model
            args.resolved_model = resolve_model(args.model, args.revision, args.download_dir)
    return args.resolved_model


def _llm_kwargs(args) -> dict:
    """LLM's keywords from a command's parsed engine flags (add_engine_args), the model a local path
    (local_model)."""
    return {**engine_kwargs(args), "model": local_model(args)}


def build_llm(args) -> LLM:
    """The LLM of a command's parsed engine flags (add_engine_args); without --model, the tiny checkpoint."""
    return LLM(**_llm_kwargs(args))


def refuse_bad_engine_args(command: str, args) -> None:
    """What the engine flags and the model's config files decide alone (a missing model or hub id, heads the TP
    size does not divide, a feature pipeline stages do not run), checked as LLM(...) would check it but before any
    rank starts and without reading a weight: a user's error is one line, `COMMAND: why`, and exit code 2
    (argparse's), not a traceback from inside the engine. A hub id is resolved here, once (local_model)."""
    try:
        kwargs = _llm_kwargs(args)
        EngineConfig.from_kwargs(kwargs.pop("model"), **kwargs).validate()
    except (ValueError, TypeError) as exc:
        print(f"{command}: {exc}", file=sys.stderr)
        sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
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
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                min_p=args.min_p, repetition_penalty=args.repetition_penalty, stop=args.stop,
                                max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    refuse_bad_engine_args("generate", args)
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
