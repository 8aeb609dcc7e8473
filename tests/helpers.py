"""Shared pieces of the engine tests: a transformers greedy reference and a fixed prompt mix."""
import random

import torch


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with transformers' KV cache, never stopping at EOS (the engine uses ignore_eos)."""
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        past, tokens = out.past_key_values, []
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
    return tokens


def mixed_prompts(vocab_size: int, lengths=(1, 7, 16, 33, 64, 100, 180, 257, 300), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(vocab_size: int, prefix_len: int, tails=(5, 17, 40, 1), seed: int = 1):
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab_size) for _ in range(n)] for n in tails]
