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


USAGE = "%(prog)s [--model MODEL] [--prompt TEXT ...] [options]"
DESCRIPTION = """\
Print completions for prompts, offline (no server). Without --model: the
embedded tiny checkpoint, whose output is fluent nonsense (random weights).

Defaults that differ from the API's: generate is greedy (--temperature 0) and
writes up to 48 tokens (--max-tokens 48), whatever the model's generation
config says; SamplingParams and the server's /v1/completions default to
temperature 1.0 and 16 tokens (vLLM's), unless the model's
generation_config.json sets others (--generation-config).

examples:
  nanovllm-tp generate --prompt "The quick brown fox"
  nanovllm-tp generate --model DIR --chat --prompt "Hello"
  nanovllm-tp generate --model Qwen/Qwen3-0.6B --chat --prompt "Hi" --temperature 0.6
"""
DEFAULT_PROMPTS = ["The quick brown fox", "Return a list of"]


def build_parser() -> argparse.ArgumentParser:
    from nanovllm_tp.launch.help_format import HelpFormatter
    parser = argparse.ArgumentParser(usage=USAGE, description=DESCRIPTION, formatter_class=HelpFormatter,
                                     epilog="Every engine flag is also an LLM(...) keyword: docs/knobs.md.")
    g = parser.add_argument_group("prompts and sampling")
    g.add_argument("--prompt", action="append", metavar="TEXT",
                   help=f"a prompt (repeat for several) (default: {' and '.join(map(repr, DEFAULT_PROMPTS))})")
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template as one user message (default: off)")
    g.add_argument("--max-tokens", type=int, default=48,
                   help="most tokens to generate per completion (default: 48; the API's: 16)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0: greedy (default: 0, greedy; the API's: 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1: off (default: 1.0)")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens; 0: off (default: 0)")
    g.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below min-p x the likeliest token's probability; 0: off (default: 0.0)")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalty on tokens of the prompt and output; 1: off (default: 1.0)")
    g.add_argument("--n", type=int, default=1, help="completions per prompt (default: 1)")
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="a stop string (repeat for several) (default: none)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="go on past the end-of-sequence token, up to --max-tokens (default: off)")
    add_engine_args(parser)
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
    prompts = args.prompt or DEFAULT_PROMPTS
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
