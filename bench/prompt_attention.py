"""A prompt's causal attention on CPU, per prompt length: SDPA (the torch backend's prefill) against the C decode
kernel taking each token as a decode row over its KV in place (what the `cpu` backend does for prompts of up to
its `prompt_as_decode` tokens), same run.

    python -m nanovllm_tp.bench.prompt_attention --threads 2
    python -m nanovllm_tp.bench.prompt_attention --heads 32 --kv-heads 8 --head-dim 64 --lengths 140 512 2048

One prompt of each --lengths, bf16: random queries, keys and values, the keys and values also written to a paged
cache of --block-size blocks at random places (the decode kernel reads them there; SDPA reads the contiguous
copy, as the backend passes a whole prompt's own K/V). Each repeat times both in turns (alternating which goes
first); medians. Reported per length: milliseconds, GFLOP/s (the causal product's 4 * L^2 / 2 * heads * head_dim
FLOPs), SDPA's time over the kernel's, and the largest difference between the two outputs.
"""
from __future__ import annotations

import argparse
import time

from nanovllm_tp.bench import common as bc

NAME = "bench_prompt_attention"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 140, 256, 512, 1024, 2048])
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    bc.add_output_args(parser)
    return parser


def make_prompt(args, length: int, gen):
    """(q, k, v) of one prompt, and its K/V in a paged cache with every token's block table and length."""
    import torch
    shape = (length, args.kv_heads, args.head_dim)
    q = torch.randn(length, args.heads, args.head_dim, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(shape, generator=gen).to(torch.bfloat16) for _ in range(2))
    blocks = -(-length // args.block_size)
    where = torch.randperm(2 * blocks, generator=gen)[:blocks]          # half the pool unused: scattered blocks
    cache_shape = (2 * blocks, args.block_size, args.kv_heads, args.head_dim)
    k_cache, v_cache = torch.zeros(cache_shape, dtype=torch.bfloat16), torch.zeros(cache_shape, dtype=torch.bfloat16)
    slots = (where[:, None] * args.block_size + torch.arange(args.block_size)).flatten()[:length]
    k_cache.view(-1, args.kv_heads, args.head_dim)[slots] = k
    v_cache.view(-1, args.kv_heads, args.head_dim)[slots] = v
    table = where[None, :].expand(length, blocks).to(torch.int32).contiguous()
    lens = torch.arange(1, length + 1, dtype=torch.int32)
    return q, k, v, k_cache, v_cache, table, lens


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.heads % args.kv_heads or min(args.lengths + [args.repeats]) < 1:
        raise SystemExit("need --heads a multiple of --kv-heads and positive --lengths and --repeats")
    bc.apply_threads(args)
    import torch
    import torch.nn.functional as F
    from nanovllm_tp.layers import cpu_kernels
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here (no C compiler or a failed build)")
    env, gen = bc.environment(), torch.Generator().manual_seed(args.seed)
    scale = args.head_dim ** -0.5
    rows, figures = [], {}
    for length in args.lengths:
        q, k, v, k_cache, v_cache, table, lens = make_prompt(args, length, gen)

        def sdpa():
            return F.scaled_dot_product_attention(*(t.unsqueeze(0).transpose(1, 2) for t in (q, k, v)),
                                                  is_causal=True, scale=scale, enable_gqa=True)[0].transpose(0, 1)

        def kernel():
            return kernels.paged_decode(q, k_cache, v_cache, table, lens, scale)

        calls = max(1, 4096 // length)          # calls per timing: a few milliseconds even for short prompts
        times = {"sdpa": [], "kernel": []}
        runs = (("sdpa", sdpa), ("kernel", kernel))
        for name, fn in runs:
            fn()
        for r in range(args.repeats):
            for name, fn in (runs if r % 2 == 0 else runs[::-1]):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter() - t0) / calls)
        med = {name: bc.median(ts) for name, ts in times.items()}
        flops = 4 * length * length / 2 * args.heads * args.head_dim
        diff = (sdpa().float() - kernel().float()).abs().max().item()
        figures[length] = {"sdpa_ms": med["sdpa"] * 1e3, "kernel_ms": med["kernel"] * 1e3,
                           "sdpa_gflop_s": flops / med["sdpa"] / 1e9, "kernel_gflop_s": flops / med["kernel"] / 1e9,
                           "speedup": med["sdpa"] / med["kernel"], "max_abs_diff": diff}
        f = figures[length]
        rows.append([str(length), f"{f['sdpa_ms']:.3f}", f"{f['sdpa_gflop_s']:.0f}", f"{f['kernel_ms']:.3f}",
                     f"{f['kernel_gflop_s']:.0f}", f"{f['speedup']:.2f}x", f"{diff:.3g}"])
        bc.log(args, f"length {length}: sdpa {f['sdpa_ms']:.3f} ms, kernel {f['kernel_ms']:.3f} ms")
    title = (f"{NAME}: one bf16 prompt per length, {args.heads} q / {args.kv_heads} KV heads of {args.head_dim}, "
             f"block {args.block_size}, torch threads {env['torch_threads']}; median of {args.repeats}")
    table = bc.format_table(["tokens", "SDPA ms", "GFLOP/s", "C decode rows ms", "GFLOP/s", "SDPA / kernel",
                             "max |diff|"], rows, title)
    return bc.finish(args, NAME, env, table, figures=figures)


if __name__ == "__main__":
    main()
