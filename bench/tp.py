"""Parallel layouts: the bench throughput workload at TP = 1, 2, ... and, with --pp-list, at every TP x PP.

    python -m nanovllm_tp.bench.tp                         # --preset small, TP 1 and 2 on CPU
    python -m nanovllm_tp.bench.tp --tp-list 1 2 4 --preset tiny --repeats 3 --plot
    python -m nanovllm_tp.bench.tp --tp-list 1 2 --pp-list 1 2  # TP=1, TP=2, PP=2 and TP=2 x PP=2
    python -m nanovllm_tp.bench.tp --tp-list 1 --pp-list 1 2 --micro-batches 1 2 --rounds 3 --trace t.json
                                                    # PP=2 with one step in flight against one per stage

Each layout runs in a fresh process, `python -m nanovllm_tp.bench.throughput --tp N -pp P --out TMP.json` (the
engine spawns its other ranks itself), with OMP_NUM_THREADS=--threads-per-rank (default 1: one CPU thread per
rank, so a layout of N ranks uses N cores). Its JSON is read back; this script reports tok/s per layout, the
scaling against the first layout (the fewest ranks), and the efficiency per rank. Arguments it does not know are
passed on to bench unchanged (e.g. --max-num-seqs 64, --no-prefix-caching, --dtype bfloat16).

--micro-batches runs every pipeline layout at each count of steps in flight (the engine's pipeline_micro_batches;
default: one per stage). --rounds R runs the whole list of layouts R times in turn, so that a machine's slow minute
falls on every layout alike, and reports each layout's median over the rounds. With --trace, a pipeline layout's
row also says how much of steady decode every stage computed at once (bench/stage_overlap.py).

Default workload: 32 requests, prompt and output lengths 16..128, on the "small" preset (1024 hidden, 8 layers,
random weights, compute-bound on CPU), so one TP size takes well under a minute on a 2-core machine.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tempfile
import time

from nanovllm_tp.bench import common as bc
from nanovllm_tp.utils.trace import sibling_path

NAME = "bench_tp"


def default_tp_list() -> list[int]:
    """Every power of two up to the device count: GPUs when there are any, else min(2, cores)."""
    try:
        import torch
        devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except (ImportError, RuntimeError):
        devices = 0
    if not devices:
        devices = min(2, os.cpu_count() or 1)
    sizes, n = [], 1
    while n <= devices:
        sizes.append(n)
        n *= 2
    return sizes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp-list", type=int, nargs="+", help=f"TP sizes (default: {default_tp_list()})")
    parser.add_argument("--pp-list", type=int, nargs="+", default=[1],
                        help="pipeline-parallel sizes: every TP size runs at each (default: 1)")
    parser.add_argument("--model", help="Hugging Face model directory (default: --preset)")
    bc.add_workload_args(parser, num_requests=32, prompt_len=(16, 128), output_len=(16, 128))
    parser.set_defaults(preset="small")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[0],
                        help="pipeline layouts: steps in flight at once, each count a layout of its own (default: "
                             "the engine's, one per stage)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per TP size (bench reports the median)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run every layout this many times in turn; each layout's figure is its median")
    parser.add_argument("--threads-per-rank", type=int, default=1, help="OMP_NUM_THREADS of every rank")
    parser.add_argument("--timeout", type=float, default=900, help="seconds allowed per TP size")
    parser.add_argument("--trace", metavar="OUT.json", help="a Perfetto trace per TP size: OUT.tp1.json, ...")
    bc.add_output_args(parser)
    return parser


def label(tp: int, pp: int, mb: int = 0) -> str:
    """A layout's name in the table: TP=2, or TP=2xPP=2 with pipeline stages, "mb=1" with a micro-batch count."""
    return f"TP={tp}" if pp == 1 else f"TP={tp}xPP={pp}" + (f" mb={mb}" if mb else "")


def run_one(tp: int, args, passthrough: list[str], workdir: str, pp: int = 1, mb: int = 0) -> dict:
    name = f"tp{tp}" if pp == 1 else f"tp{tp}pp{pp}" + (f"mb{mb}" if mb else "")
    out = os.path.join(workdir, f"{name}.json")
    cmd = [sys.executable, "-m", "nanovllm_tp.bench.throughput", "--tp", str(tp),
           "--pipeline-parallel-size", str(pp), *(["--pipeline-micro-batches", str(mb)] if mb else []), "--out", out,
           "--preset", args.preset, "--num-requests", str(args.num_requests),
           "--prompt-len", *map(str, args.prompt_len), "--output-len", *map(str, args.output_len),
           "--temperature", str(args.temperature), "--seed", str(args.seed), "--repeats", str(args.repeats),
           *(["--model", args.model] if args.model else []), *(["--quiet"] if args.quiet else []),
           *(["--trace", sibling_path(args.trace, name)] if args.trace else []), *passthrough]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank))
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "TORCHELASTIC_RUN_ID", "GROUP_RANK"):
        env.pop(var, None)      # each size is a plain spawn-mode run, even if we were started by torchrun
    bc.log(args, f"--- {label(tp, pp, mb)}: {' '.join(cmd[1:])}")
    t0 = time.perf_counter()
    # the child's table and progress go to our stderr: our own table stays the last thing on stdout
    sys.stderr.flush()
    try:
        sink = sys.stderr.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        sink = None          # stderr is not a file (e.g. captured in-process): relay the child's output
    if sink is not None:
        proc = subprocess.run(cmd, env=env, stdout=sink, stderr=sink, timeout=args.timeout, check=False)
    else:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout,
                              check=False)
        sys.stderr.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"bench at {label(tp, pp, mb)} failed with exit code {proc.returncode}: {' '.join(cmd)}")
    with open(out) as f:
        child = json.load(f)
    engine = child["figures"]["engine"]
    overlap = None
    if args.trace and pp > 1:
        from nanovllm_tp.bench.stage_overlap import read
        overlap = read(sibling_path(args.trace, name), tp)
    return {"tp": tp, "pp": pp, "micro_batches": mb or None, "ranks": tp * pp, "layout": label(tp, pp, mb),
            "tok_s": engine["tok_s"], "seconds": engine["seconds"], "tok_s_runs": engine["tok_s_runs"],
            "lengths_ok": engine["lengths_ok"], "runner": engine.get("runner"),
            "max_steps_in_flight": engine.get("max_steps_in_flight"), "wall_s": time.perf_counter() - t0,
            "stage_overlap": overlap, "command": cmd, "child_environment": child["environment"],
            "child_config": child["config"]}


def table(result: dict) -> str:
    w, c, f = result["workload"], result["config"], result["figures"]
    overlap = any(r.get("stage_overlap") for r in f["runs"])
    rows = [[r["layout"], r["ranks"], r["tok_s"], f"{r['seconds']:.3f}", f"{f['scaling'][key(r)]:.2f}x",
             f"{f['efficiency'][key(r)]:.0%}"] + ([_overlap_cell(r.get("stage_overlap"))] if overlap else [])
            for r in f["runs"]]
    rounds = f" of {c.get('rounds', 1)} rounds" if c.get("rounds", 1) > 1 else f" of {c['repeats']}"
    title = (f"bench_tp: {w['num_requests']} requests, prompt {w['prompt_len_min']}..{w['prompt_len_max']}, output "
             f"{w['output_len_min']}..{w['output_len_max']}, {c['model_source']}, {c['threads_per_rank']} thread(s) "
             f"per rank, median{rounds}")
    return bc.format_table(["layout", "ranks", "output tok/s", "seconds", f"vs {f['base_layout']}", "efficiency"]
                           + (["stages computing at once (steady decode)"] if overlap else []), rows, title)


def _overlap_cell(overlap: dict | None) -> str:
    if not overlap:
        return ""
    busy = " / ".join(f"{share:.0%}" for share in overlap["busy"].values())
    return f"{overlap['all_busy']:.0%} (each busy {busy})"


def key(run: dict) -> str:
    """A run's key in figures' scaling and efficiency: "2" for TP=2 (as before pipeline layouts), "2x2" for
    TP=2 x PP=2, "1x2/mb1" with a micro-batch count."""
    name = str(run["tp"]) if run["pp"] == 1 else f"{run['tp']}x{run['pp']}"
    return name + (f"/mb{run['micro_batches']}" if run.get("micro_batches") else "")


def draw(result: dict):
    def _draw(plt):
        f = result["figures"]
        ranks = [r["ranks"] for r in f["runs"]]
        base = f["runs"][0]["tok_s"] / f["runs"][0]["ranks"]
        fig, ax = plt.subplots(figsize=(5, 4))
        ax.plot(ranks, [r["tok_s"] for r in f["runs"]], "o", label="measured")
        for r in f["runs"]:
            ax.annotate(r["layout"], (r["ranks"], r["tok_s"]), fontsize=7)
        ax.plot(sorted(set(ranks)), [base * n for n in sorted(set(ranks))], "k:", label="linear")
        ax.set_xticks(sorted(set(ranks)))
        ax.set_xlabel("ranks (TP x PP)")
        ax.set_ylabel("output tokens / s")
        ax.set_title(f"parallel scaling, {result['config']['model_source']}")
        ax.legend()
        return fig
    return _draw


def main(argv=None) -> dict:
    args, passthrough = build_parser().parse_known_args(argv)
    tps = sorted(set(args.tp_list or default_tp_list()))
    pps = sorted(set(args.pp_list))
    if not tps or min(tps) < 1 or min(pps) < 1:
        raise SystemExit(f"--tp-list and --pp-list need sizes >= 1, got {args.tp_list} and {args.pp_list}")
    if min(args.micro_batches) < 0 or args.rounds < 1:
        raise SystemExit(f"--micro-batches needs counts >= 1 and --rounds >= 1, got {args.micro_batches} and "
                         f"{args.rounds}")
    mbs = sorted(set(args.micro_batches))
    layouts = sorted(((tp, pp, mb if pp > 1 else 0) for tp in tps for pp in pps for mb in mbs),
                     key=lambda layout: (layout[0] * layout[1], layout[1], layout[2]))
    layouts = list(dict.fromkeys(layouts))      # one TP-only layout whatever the micro-batch counts
    args.model_source = args.model or f"preset {args.preset}"
    env = bc.environment()
    env["OMP_NUM_THREADS_children"] = str(args.threads_per_rank)
    out_path = bc.out_path(args, NAME)
    if not args.model:   # make the checkpoint once, here, rather than racing in the first child
        from nanovllm_tp.launch.make_tiny import ensure_tiny
        ensure_tiny(args.preset)
    rounds: list[list[dict]] = [[] for _ in layouts]
    with tempfile.TemporaryDirectory(prefix="bench_tp-") as workdir:
        for _ in range(args.rounds):
            for i, (tp, pp, mb) in enumerate(layouts):
                rounds[i].append(run_one(tp, args, passthrough, workdir, pp, mb))
                bc.log(args, f"{label(tp, pp, mb)}: {rounds[i][-1]['tok_s']:.1f} tok/s")
    runs = [_median_run(each) for each in rounds]
    base = runs[0]
    figures = {"runs": runs, "base_tp": base["tp"], "base_layout": base["layout"],
               "scaling": {key(r): r["tok_s"] / base["tok_s"] for r in runs},
               "efficiency": {key(r): r["tok_s"] / base["tok_s"] * base["ranks"] / r["ranks"] for r in runs}}
    config = {**bc.config_dict(args), "tp_list": tps, "pp_list": pps, "micro_batches": mbs, "rounds": args.rounds,
              "passthrough": passthrough}
    vocab = bc.model_vocab_size(base["child_config"]["model"])
    workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed, vocab)
    result = {"name": NAME, "config": config, "workload": workload.describe(),
              "environment": bc.finish_environment(env), "figures": figures}
    bc.save_result(args, out_path, result, draw)
    print(table(result), flush=True)
    return result


def _median_run(each: list[dict]) -> dict:
    """A layout's run over the rounds: the figures of its lower-middle round, tok/s their median, every round's
    tok/s beside."""
    tok_s = [r["tok_s"] for r in each]
    run = dict(sorted(each, key=lambda r: r["tok_s"])[(len(each) - 1) // 2])
    run["tok_s"], run["tok_s_rounds"] = bc.median(tok_s), tok_s
    return run


if __name__ == "__main__":
    main()
