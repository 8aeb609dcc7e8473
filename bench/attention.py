"""The CPU paged decode attention kernel alone: its AVX-512 form against the portable loop, per KV cache format,
same run.

    python -m nanovllm_tp.bench.attention --threads 1
    python -m nanovllm_tp.bench.attention --rows 32 --context 256 --heads 9 --kv-heads 3 --head-dim 64

One decode step's attention over --layers layers (default 30, SmolLM2's; each layer its own cache, so a step reads
what an engine's step reads, not what a cache level holds): --rows rows of --context tokens each, their blocks at
random places in each layer's pool (--block-size, default 16, the CPU backend's). Random queries, keys and values;
quantized caches hold random codes and scales. Each repeat times one step per (format, kernel) pair in a rotating
order, so load from other processes hits them alike; medians over the repeats. Reported per format: milliseconds
per layer, the GB/s of KV bytes (values and scales) that is, and the vector form against the portable loop; then
each format's vector time against the first format's (bf16 by default: what int8 KV saves next to bf16 KV).
"""
from __future__ import annotations

import argparse
import time

from nanovllm_tp.bench import common as bc

NAME = "bench_attention"
FORMATS = ("bf16", "float32", "int8", "fp8_e4m3", "fp8_e5m2")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv", nargs="+", default=["bf16", "int8"], choices=FORMATS,
                        help="cache formats, the first the baseline (queries bf16, float32 for a float32 cache)")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=256, help="tokens of each row")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    bc.add_output_args(parser)
    return parser


def make_layers(args, fmt: str, gen):
    """Per layer: (k, v, scales or None), and the rows' block tables and lens, and the queries."""
    import torch
    from nanovllm_tp.layers.attention.kv_quant import KV_CACHE_DTYPES
    per_row = -(-args.context // args.block_size)
    blocks = args.rows * per_row * 2            # half the pool unused: the rows' blocks are scattered
    shape = (blocks, args.block_size, args.kv_heads, args.head_dim)
    layers = []
    for _ in range(args.layers):
        if fmt in ("bf16", "float32"):
            dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
            k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
            layers.append((k, v, None))
            continue
        dtype = KV_CACHE_DTYPES[fmt]
        if dtype is torch.int8:
            k, v = (torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8) for _ in range(2))
        else:
            k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
        scales = tuple(torch.rand(shape[:3], generator=gen) / 64 for _ in range(2))
        layers.append((k, v, scales))
    table = torch.randperm(blocks, generator=gen)[:args.rows * per_row].view(args.rows, per_row).to(torch.int32)
    lens = torch.full((args.rows,), args.context, dtype=torch.int32)
    q = torch.randn(args.rows, args.heads, args.head_dim, generator=gen)
    q = q.float() if fmt == "float32" else q.to(torch.bfloat16)
    return layers, table, lens, q


def kv_bytes(args, layers) -> int:
    """Bytes of K/V (and scales) one layer's step reads."""
    k, _, scales = layers[0]
    per_token = args.kv_heads * args.head_dim * k.element_size() + (4 * args.kv_heads if scales else 0)
    return 2 * args.rows * args.context * per_token


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.heads % args.kv_heads or min(args.rows, args.context, args.layers, args.repeats) < 1:
        raise SystemExit("need --heads a multiple of --kv-heads and positive --rows, --context, --layers, --repeats")
    bc.apply_threads(args)
    import torch
    from nanovllm_tp.layers import cpu_kernels
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the CPU kernels are not available here (no C compiler or a failed build)")
    env, gen = bc.environment(), torch.Generator().manual_seed(args.seed)
    cases = {fmt: make_layers(args, fmt, gen) for fmt in args.kv}
    pairs = [(fmt, portable) for fmt in args.kv for portable in (False, True)]
    times = {pair: [] for pair in pairs}

    def step(fmt: str, portable: bool) -> float:
        layers, table, lens, q = cases[fmt]
        t0 = time.perf_counter()
        for k, v, scales in layers:
            kernels.paged_decode(q, k, v, table, lens, args.head_dim ** -0.5, kv_scales=scales, portable=portable)
        return (time.perf_counter() - t0) / len(layers)

    for pair in pairs:              # warm-up: first touches of each pool
        step(*pair)
    for r in range(args.repeats):
        for i in range(len(pairs)):
            pair = pairs[(i + r) % len(pairs)]
            times[pair].append(step(*pair))
        bc.log(args, f"[{r + 1}/{args.repeats}] " + ", ".join(
            f"{fmt} {'portable' if p else 'vector'} {times[fmt, p][-1] * 1e3:.3f} ms" for fmt, p in pairs))
    med = {pair: bc.median(ts) for pair, ts in times.items()}
    base = med[args.kv[0], False]
    rows, figures = [], {}
    for fmt in args.kv:
        nbytes = kv_bytes(args, cases[fmt][0])
        vec, old = med[fmt, False], med[fmt, True]
        figures[fmt] = {"vector_ms": vec * 1e3, "portable_ms": old * 1e3, "kv_bytes_per_layer": nbytes,
                        "vector_gb_s": nbytes / vec / 1e9, "portable_gb_s": nbytes / old / 1e9,
                        "speedup": old / vec, "against_first": base / vec}
        f = figures[fmt]
        rows.append([fmt, f"{f['portable_ms']:.3f}", f"{f['portable_gb_s']:.1f}", f"{f['vector_ms']:.3f}",
                     f"{f['vector_gb_s']:.1f}", f"{f['speedup']:.2f}x", f"{f['against_first']:.2f}x"])
    title = (f"{NAME}: {args.rows} rows x {args.context} tokens, {args.heads} q / {args.kv_heads} KV heads of "
             f"{args.head_dim}, block {args.block_size}, {args.layers} layers, torch threads {env['torch_threads']}, "
             f"vector form {'built' if kernels.decode_simd else 'absent (portable twice)'}; median of {args.repeats}")
    table = bc.format_table(["kv", "portable ms/layer", "GB/s", "vector ms/layer", "GB/s", "vector speedup",
                             f"vector vs {args.kv[0]}"], rows, title)
    return bc.finish(args, NAME, env, table, figures=figures)


if __name__ == "__main__":
    main()
