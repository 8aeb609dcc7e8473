"""Perplexity of a model on a text file, measured through the engine itself (prompt logprobs), so that a quantized
run can be judged against its dense twin or another engine.

    python -m nanovllm_tp.launch.perplexity --model M --text FILE [--ctx 512 --stride 256] [engine flags]
    python -m nanovllm_tp.launch.perplexity --model M.gguf --text FILE --ctx 512 --llama-cpp

The text is tokenized once (with the special tokens the tokenizer adds, a BOS for instance). Windows:
- default, the sliding window of transformers' perplexity recipe: windows of --ctx tokens starting every --stride
  tokens; each scores the tokens no window before it scored (the first: all but its first token), with the whole
  window before them as context; the last window ends at the text's end.
- --llama-cpp, llama-perplexity's own chunking, to compare with its figure: disjoint chunks of --ctx tokens (a
  partial last chunk dropped), each starting with BOS where the tokenizer adds one, each scoring its second half
  (the tokens after position ctx / 2).
PPL = exp(mean negative log-likelihood over the scored tokens). All windows go to the engine at once (it batches
them); tokens/s counts every token of every window, as llama-perplexity's does.
"""
import argparse
import math
import time
from dataclasses import dataclass

from nanovllm_tp import SamplingParams
from nanovllm_tp.bench.common import apply_threads
from nanovllm_tp.config.engine_config import add_engine_args


@dataclass(slots=True)
class Window:
    start: int          # first token of the window in the text
    end: int            # one past its last
    scored: int         # the tokens scored are start + scored .. end - 1 (scored >= 1)


def sliding_windows(n_tokens: int, ctx: int, stride: int) -> list[Window]:
    if ctx < 2 or not 0 < stride <= ctx:
        raise ValueError(f"need ctx >= 2 and 0 < stride <= ctx, got ctx={ctx}, stride={stride}")
    if n_tokens < 2:
        raise ValueError(f"the text has {n_tokens} token(s): at least 2 are needed")
    windows, done = [], 1          # done: tokens up to here are scored (token 0 never is)
    for start in range(0, n_tokens, stride):
        end = min(start + ctx, n_tokens)
        windows.append(Window(start, end, done - start))
        done = end
        if end == n_tokens:
            break
    return windows


def llama_cpp_windows(n_tokens: int, ctx: int) -> list[Window]:
    if ctx < 4:
        raise ValueError(f"need ctx >= 4, got {ctx}")
    if n_tokens < 2 * ctx:
        raise ValueError(f"llama.cpp's chunking needs at least 2 * ctx = {2 * ctx} tokens, the text has {n_tokens}")
    return [Window(i * ctx, (i + 1) * ctx, ctx // 2 + 1) for i in range(n_tokens // ctx)]


@dataclass(slots=True)
class Perplexity:
    ppl: float
    nll: float          # mean negative log-likelihood
    scored: int         # tokens scored
    evaluated: int      # tokens run through the model
    seconds: float

    def line(self) -> str:
        return (f"PPL = {self.ppl:.4f} (mean NLL {self.nll:.5f}) over {self.scored} scored tokens; "
                f"{self.evaluated} tokens evaluated in {self.seconds:.1f} s: {self.evaluated / self.seconds:.0f} tok/s")


def perplexity(llm, ids: list[int], windows: list[Window], bos: int | None = None) -> Perplexity:
    """Through llm's prompt logprobs; bos: put in place of each window's first token (llama.cpp's chunks)."""
    prompts = [([bos] if bos is not None else []) + ids[w.start + (bos is not None):w.end] for w in windows]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    began = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - began
    nll, scored = 0.0, 0
    for w, prompt, out in zip(windows, prompts, outs):
        for pos in range(w.scored, len(prompt)):
            nll -= out.prompt_logprobs[pos][prompt[pos]].logprob
            scored += 1
    return Perplexity(math.exp(nll / scored), nll / scored, scored, sum(map(len, prompts)), seconds)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(parser)
    parser.add_argument("--text", required=True, help="a UTF-8 text file")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per window")
    parser.add_argument("--stride", type=int, default=None, help="tokens between window starts (default ctx / 2)")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="llama-perplexity's chunking: disjoint chunks of ctx, each scoring its second half")
    parser.add_argument("--max-tokens", type=int, default=None, help="use the text's first N tokens only")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: the engine's)")
    return parser


def main(argv=None) -> Perplexity:
    from nanovllm_tp.launch.generate import build_llm
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.llama_cpp and args.stride is not None:
        parser.error("--stride does not apply to --llama-cpp's disjoint chunks")
    apply_threads(args)
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    if args.max_model_len is None:
        args.max_model_len = args.ctx + 1
    llm = build_llm(args)
    try:
        ids = llm.tokenizer(text)["input_ids"][:args.max_tokens]
        try:
            windows = (llama_cpp_windows(len(ids), args.ctx) if args.llama_cpp
                       else sliding_windows(len(ids), args.ctx, args.stride or max(1, args.ctx // 2)))
        except ValueError as exc:
            parser.error(str(exc))
        bos = llm.tokenizer.bos_token_id if args.llama_cpp and ids[:1] == [llm.tokenizer.bos_token_id] else None
        result = perplexity(llm, ids, windows, bos)
        print(f"{llm.config.model}: {len(ids)} tokens, {len(windows)} windows of {args.ctx}; {result.line()}")
        return result
    finally:
        llm.close()


if __name__ == "__main__":
    main()
