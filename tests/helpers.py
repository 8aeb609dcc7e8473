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


def random_paged_decode(lens, block_size: int, kv_heads: int, group: int, head_dim: int, spare_blocks: int = 3):
    """A decode batch over a paged cache: each row's blocks scattered (non-monotonic ids) through the pool.
    Returns q [rows, heads, dim], k/v caches, block tables (-1 past a row's blocks) and int32 context lens."""
    import torch
    blocks_needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks_needed) + spare_blocks
    free = torch.randperm(num_blocks).tolist()
    table = torch.full((len(lens), max(blocks_needed) + 1), -1, dtype=torch.int32)
    for row, n in enumerate(blocks_needed):
        table[row, :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim)
    q = torch.randn(len(lens), kv_heads * group, head_dim)
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)
