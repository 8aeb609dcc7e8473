"""The benchmarks' workload, nano-vllm's bench.py shape: N requests; each prompt is random token ids and its
length, like its output length, is uniform in an inclusive range; every request runs with ignore_eos, so it
produces exactly the requested number of tokens. Lengths and ids come from one seeded generator, so a seed fixes
the workload."""
from __future__ import annotations

import random
from dataclasses import dataclass

MAX_TOKEN_ID = 10000          # nano-vllm draws prompt ids from [0, 10000]; smaller vocabs are clamped


@dataclass
class Workload:
    prompt_lens: list[int]
    output_lens: list[int]
    seed: int
    vocab_size: int

    @property
    def num_requests(self) -> int:
        return len(self.prompt_lens)

    @property
    def requested_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    def prompts(self, draw: int = 0) -> list[list[int]]:
        """The prompts' token ids. `draw` > 0 redraws the ids (same lengths): the compute is the same, but a
        repeat cannot hit the prefix cache filled by the previous one. Every engine gets the same draw."""
        rng = random.Random(f"{self.seed}/tokens/{draw}")
        hi = min(MAX_TOKEN_ID, self.vocab_size - 1)
        return [[rng.randint(0, hi) for _ in range(n)] for n in self.prompt_lens]

    def describe(self) -> dict:
        return {"num_requests": self.num_requests, "seed": self.seed, "vocab_size": self.vocab_size,
                "prompt_tokens": self.prompt_tokens, "requested_output_tokens": self.requested_output_tokens,
                "prompt_len_min": min(self.prompt_lens), "prompt_len_max": max(self.prompt_lens),
                "output_len_min": min(self.output_lens), "output_len_max": max(self.output_lens),
                "token_ids": "uniform in [0, min(10000, vocab-1)]; redrawn (same lengths) for every repeat so the "
                             "prefix cache cannot hit across repeats; all engines get the same draw"}


def make_workload(num_requests: int, prompt_len: tuple[int, int], output_len: tuple[int, int], seed: int,
                  vocab_size: int) -> Workload:
    for name, (lo, hi) in (("prompt-len", prompt_len), ("output-len", output_len)):
        if not 1 <= lo <= hi:
            raise ValueError(f"--{name} needs 1 <= LO <= HI, got {lo} {hi}")
    if num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {num_requests}")
    rng = random.Random(f"{seed}/lengths")
    prompt_lens = [rng.randint(*prompt_len) for _ in range(num_requests)]
    output_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    return Workload(prompt_lens, output_lens, seed, vocab_size)


def warmup_prompts(vocab_size: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """A small warm-up set: a few short requests and one longer prompt (prefill and decode paths, allocator)."""
    rng = random.Random(f"{seed}/warmup")
    hi = min(MAX_TOKEN_ID, vocab_size - 1)
    lens = [8, 16, 24, 96]
    return [[rng.randint(0, hi) for _ in range(n)] for n in lens], [8, 8, 8, 4]


def shared_prefix_prompts(workload: Workload, draw: int, num_prefixes: int, prefix_len: int) -> list[list[int]]:
    """Each of the workload's random prompts after one of `num_prefixes` fixed random prefixes of `prefix_len` tokens
    (the same in every draw: what a later draw finds cached is the prefix, never the random rest); which prefix is
    drawn anew for each draw."""
    if num_prefixes < 1 or prefix_len < 0:
        raise ValueError(f"need at least one prefix and a prefix length >= 0, got {num_prefixes}, {prefix_len}")
    rng = random.Random(f"{workload.seed}/prefixes")
    top = min(MAX_TOKEN_ID, workload.vocab_size - 1)
    prefixes = [[rng.randint(0, top) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    pick = random.Random(f"{workload.seed}/pick/{draw}")
    return [prefixes[pick.randrange(len(prefixes))] + list(p) for p in workload.prompts(draw)]
