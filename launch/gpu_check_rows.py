"""What gpu_check's parts share: the sizes of a GPU run and of the CPU dry run, a row of the table, and greedy
tokens compared with a reference, prompt by prompt."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Sizes:
    prompts: int                    # exactness prompts, their lengths and output lengths
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    preset: str                     # throughput: make_tiny preset, requests, their prompt and output lengths
    requests: int
    lens: tuple[int, int]
    hf_requests: int                # the first N requests, also run by transformers


GPU = Sizes(16, (1, 300), (8, 32), "qwen3-0.6b", 256, (100, 1024), 64)
DRY = Sizes(8, (1, 160), (4, 12), "tiny", 12, (8, 48), 4)


@dataclass(slots=True)
class Row:
    part: str
    check: str
    result: str
    status: str         # PASS, FAIL, SKIP or INFO (a figure)


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts), else None."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def compare_tokens(got: list[list[int]], want: list[list[int]], within: int | None = None) -> tuple[str, str]:
    """PASS or FAIL, and a summary, for greedy tokens against a reference, prompt by prompt. within=None: every
    token must match. within=k (half precision, where a near-tie may flip): at most 1 prompt in 8 may differ in
    its first k tokens; a real fault (a wrong KV slot, a stale graph input) breaks most prompts at once."""
    if len(got) != len(want):
        return "FAIL", f"{len(got)} outputs for {len(want)} prompts"
    diffs = {i: d for i, (a, b) in enumerate(zip(got, want)) if (d := first_diff(a, b)) is not None}
    summary = f"{len(got) - len(diffs)}/{len(got)} identical" + (f", first differences {diffs}" if diffs else "")
    early = len(diffs) if within is None else sum(d < within for d in diffs.values())
    return ("PASS" if early <= (0 if within is None else len(got) // 8) else "FAIL"), summary


def greedy(llm, prompts, lens, logprobs: int | None = None):
    from nanovllm_tp import SamplingParams
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=logprobs) for m in lens]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]
