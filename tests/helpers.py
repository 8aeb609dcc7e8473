"""Shared pieces of the engine tests: the transformers greedy reference and fixed prompt mixes."""
import random

from nanovllm_tp.launch.make_tiny import hf_greedy  # noqa: F401  (re-exported for the tests)


def mixed_prompts(vocab_size: int, lengths=(1, 7, 16, 33, 64, 100, 180, 257, 300), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(vocab_size: int, prefix_len: int, tails=(5, 17, 40, 1), seed: int = 1):
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab_size) for _ in range(n)] for n in tails]
