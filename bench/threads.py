"""The default CPU thread count against every fixed one, on quiet cores and on busy ones.

Each run is `bench throughput` in a process of its own (its own thread choice and kernel table), with
--threads N or without (the default: config/cpu_threads.py follows the other processes' load), while 0 or
`--busy` processes spin (`while True: pass`, one per core by default). Runs alternate over the settings within
each repeat, loads in turn, so that the machine's drift falls on all of them alike. Printed per load: each
setting's median tok/s, the thread count the default ran, and the default's share of the best fixed setting
(the issue's target: within 15%, a share of 0.85 or more).

    nanovllm-tp bench threads --model FILE.gguf --num-requests 16 --repeats 3
"""
import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile

from nanovllm_tp import envs
from nanovllm_tp.bench import common as bc

NAME = "threads"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model directory or .gguf file (default: the tiny preset)")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=[16, 128], metavar=("LO", "HI"))
    parser.add_argument("--output-len", type=int, nargs=2, default=[16, 64], metavar=("LO", "HI"))
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every (load, setting)")
    cores = envs.cores_per_rank(1)
    parser.add_argument("--busy", type=int, default=cores, help="spinning processes of the busy load (default: one "
                                                                "per core)")
    parser.add_argument("--fixed", type=int, nargs="+", default=list(range(1, cores + 1)),
                        help="the fixed thread counts compared (default: 1 to the cores)")
    bc.add_output_args(parser)
    return parser


def one_run(args, threads: int | None, out: pathlib.Path) -> dict:
    """One `bench throughput` process: its tok/s and the thread count it ran."""
    cmd = [sys.executable, "-m", "nanovllm_tp.bench", "throughput", "--num-requests", str(args.num_requests),
           "--prompt-len", *map(str, args.prompt_len), "--output-len", *map(str, args.output_len),
           "--max-model-len", str(args.max_model_len), "--repeats", "1", "--quiet", "--out", str(out)]
    if args.model:
        cmd += ["--model", args.model]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "NANOVLLM_TP_THREADS_AUTO")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"bench threads: {' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    result = json.loads(out.read_text())
    return {"tok_s": result["figures"]["engine"]["tok_s"], "threads": result["environment"].get("torch_threads")}


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.repeats < 1 or args.busy < 0 or min(args.fixed) < 1:
        raise SystemExit("bench threads: --repeats >= 1, --busy >= 0 and --fixed counts >= 1")
    settings = ["default", *(str(n) for n in args.fixed)]
    loads = {"quiet": 0, f"{args.busy} busy": args.busy}
    runs = {load: {s: [] for s in settings} for load in loads}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for load, spinners in loads.items():
                procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(spinners)]
                try:
                    for s in (settings if r % 2 == 0 else settings[::-1]):
                        got = one_run(args, None if s == "default" else int(s), pathlib.Path(tmp) / "run.json")
                        runs[load][s].append(got)
                        bc.log(args, f"[{r + 1}/{args.repeats}] {load}, threads {s}: {got['tok_s']:.1f} tok/s "
                                     f"({got['threads']} threads)")
                finally:
                    for p in procs:
                        p.kill()
                        p.wait()
    figures, rows = {}, []
    for load in loads:
        med = {s: bc.median(x["tok_s"] for x in runs[load][s]) for s in settings}
        best = max(settings[1:], key=lambda s: med[s])
        ran = sorted({x["threads"] for x in runs[load]["default"]})
        figures[load] = {"tok_s": med, "runs": runs[load], "best_fixed": int(best), "default_threads": ran,
                         "default/best": med["default"] / med[best]}
        for s in settings:
            rows.append([load, s + (f" (ran {'/'.join(map(str, ran))})" if s == "default" else ""),
                         f"{med[s]:.1f}", f"{med[s] / med[best]:.2f}"])
    table = bc.format_table(["load", "threads", "tok/s (median)", "of best fixed"], rows,
                            f"bench threads: {args.num_requests} requests, median of {args.repeats}")
    return bc.finish(args, NAME, bc.environment(), table, figures=figures,
                     workload={"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                               "output_len": args.output_len, "model": args.model or "tiny"})


if __name__ == "__main__":
    main()
