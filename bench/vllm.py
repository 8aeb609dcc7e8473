"""`bench --compare vllm`: the engine against vLLM (its CPU build, from its own virtualenv) in the same run.

    python -m nanovllm_tp.bench.throughput --model HF_DIR --dtype float32 --compare vllm --peer-python VENV/bin/python \
        --peer-mode both --num-requests 32 --max-model-len 1024 --repeats 3

vLLM runs in a subprocess (bench/peer.py under --peer-python), driven by JSON lines: it is never imported
here. Order: the peer's interpreter is checked (it must exist and import vllm) before anything is loaded; then the
engine is built and yields its first token (cold start), warms up; then each peer mode starts in turn (cold start,
same warm-up); then every repeat runs the engine and each peer on the same freshly drawn prompts, interleaved.
Reported: medians of output tok/s, the ratio engine / peer (of the medians, and the median of the per-repeat
ratios), greedy agreement (requests whose tokens are identical to the engine's, over all repeats; fp32 should
agree on all), cold start (LLM(...) until the first token of one prompt) and load time for both.

A peer's processes are stopped (SIGSTOP) whenever it is not answering a request: idle, vLLM's processes still
poll, and on a small machine that CPU time comes out of whichever engine is being timed.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import tempfile
import threading

from nanovllm_tp.bench import compare as bench_compare, engine as bench_engine
from nanovllm_tp.bench import common as bc
from nanovllm_tp.bench import peer as bench_peer

PEER_SCRIPT = pathlib.Path(bench_peer.__file__)
MODES = {"eager": ["eager"], "compiled": ["compiled"], "both": ["eager", "compiled"]}


def add_peer_args(parser) -> None:
    g = parser.add_argument_group("comparison with vLLM (--compare vllm)")
    g.add_argument("--peer-python", help="python of a virtualenv where vLLM is installed (--compare openvino: "
                   "OpenVINO GenAI; default $NANOVLLM_TP_OPENVINO_PYTHON)")
    g.add_argument("--peer-mode", choices=list(MODES), default="compiled",
                   help="vLLM eager (enforce_eager=True), compiled (its default, torch.compile) or both")
    g.add_argument("--peer-kv-gib", type=int, default=2, help="the peer's KV cache, GiB (vLLM: "
                   "VLLM_CPU_KVCACHE_SPACE; OpenVINO GenAI: SchedulerConfig.cache_size)")
    g.add_argument("--peer-timeout", type=float, default=1800.0, help="seconds to wait for any one peer reply")


def peer_env(kv_gib: int, threads: int) -> dict:
    """vLLM's KV cache size, and its worker's OpenMP threads bound to as many CPUs as the engine's torch threads
    (its "auto" binding keeps one core of a small machine for its scheduler process). Set in the environment,
    either wins."""
    cpus = sorted(os.sched_getaffinity(0))[:threads] if hasattr(os, "sched_getaffinity") else range(threads)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}
    return {k: os.environ.get(k, v) for k, v in env.items()}


def check_peer_python(path: str | None) -> str:
    """The vLLM version under `path`; ValueError if the interpreter is missing or cannot import vllm."""
    if not path:
        raise ValueError("--compare vllm needs --peer-python PATH (the python of a virtualenv with vLLM)")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise ValueError(f"--peer-python {path}: no such executable file")
    try:
        out = subprocess.run([path, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                             timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"--peer-python {path}: could not run it ({exc})") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ValueError(f"--peer-python {path} cannot import vllm: {last}")
    return out.stdout.strip().splitlines()[-1]


class PeerProcess:
    """One peer engine (vLLM's LLM; `script` another peer of the same protocol, bench/openvino_peer.py) in a
    subprocess of its own session; close() leaves no process behind."""

    def __init__(self, python: str, config: dict, env: dict, timeout: float, script: pathlib.Path = PEER_SCRIPT,
                 label: str = "vLLM"):
        env = {**os.environ, **env}
        self.timeout, self.log, self.label = timeout, tempfile.TemporaryFile("w+"), label
        self.proc = subprocess.Popen([python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, start_new_session=True)
        try:
            self.ready = self.ask({"op": "config", **config})
        except BaseException:
            self.close()
            raise
        self._signal(signal.SIGSTOP)

    def ask(self, message: dict) -> dict:
        self.proc.stdin.write(bench_peer.encode(message) + "\n")
        self.proc.stdin.flush()
        timer = threading.Timer(self.timeout, self._kill)
        timer.start()
        try:
            line = self.proc.stdout.readline()
        finally:
            timer.cancel()
        reply = json.loads(line) if line.strip() else {"event": "error", "message": f"it exited "
                                                        f"(status {self.proc.poll()}) or did not answer in time"}
        if reply["event"] == "error":
            raise RuntimeError(f"{self.label} peer: {reply['message']}\n--- its last log lines ---\n{self.log_tail()}")
        return reply

    def run(self, prompts, max_tokens, temperature: float, ignore_eos: bool = True) -> dict:
        self._signal(signal.SIGCONT)
        try:
            return self.ask(bench_peer.run_message(prompts, max_tokens, temperature, ignore_eos))
        finally:
            self._signal(signal.SIGSTOP)

    def log_tail(self, lines: int = 20) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().splitlines()[-lines:])

    def _signal(self, sig) -> None:
        bench_compare.signal_group(self.proc, sig)        # vLLM's engine-core process too

    def _kill(self) -> None:
        self._signal(signal.SIGKILL)

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(bench_peer.encode({"op": "quit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._kill()          # the session's stragglers too (vLLM's engine-core process)
        self.proc.wait()
        self.log.close()


# =============================================================================================== run

def check_peer(args, name: str = "bench") -> str:
    """The peer's vLLM version, once --peer-python and --model are fit for it; else SystemExit with why."""
    try:
        version = check_peer_python(args.peer_python)
        if args.model and not os.path.isfile(os.path.join(args.model, "config.json")):
            raise ValueError(f"--compare vllm needs --model to be a Hugging Face directory (config.json), got "
                             f"{args.model!r}; python -m nanovllm_tp.launch.convert MODEL.gguf DIR makes one")
    except ValueError as exc:
        raise SystemExit(f"{name}: {exc}") from None
    return version


def main(args) -> dict:
    version = check_peer(args)
    bc.apply_threads(args)
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    vocab = bc.model_vocab_size(args.model)
    workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed, vocab)
    warm_prompts, warm_outs = bc.warmup_prompts(vocab, args.seed)
    cold_prompt = warm_prompts[-1]
    llm, cold = bench_compare.cold_engine(args, cold_prompt)
    env, peers, ready = bc.environment(), {}, {}
    penv = peer_env(args.peer_kv_gib, env["torch_threads"])
    out_path = bc.out_path(args, "bench")
    runs = {"engine": []} | {m: [] for m in MODES[args.peer_mode]}
    runner, dtype = llm.engine.runner.describe(), str(llm.engine.dtype).removeprefix("torch.")
    try:
        bc.log(args, f"engine ready in {cold['load_s']:.1f}s, first token at {cold['first_token_s']:.1f}s: {runner}")
        bench_engine.warm_up_engine(llm, vocab, args.seed, args.temperature)
        config = {"model": str(args.model), "dtype": dtype,
                  "max_model_len": llm.engine.config.max_model_len, "max_num_seqs": args.max_num_seqs,
                  "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed,
                  "cold_prompt": cold_prompt}
        for mode in MODES[args.peer_mode]:
            peers[mode] = PeerProcess(args.peer_python, {**config, "enforce_eager": mode == "eager"}, penv,
                                      args.peer_timeout)
            ready[mode] = peers[mode].ready
            bc.log(args, f"vLLM {mode} ready: load {ready[mode]['load_s']:.1f}s, first token at "
                         f"{ready[mode]['first_token_s']:.1f}s")
            peers[mode].run(warm_prompts, warm_outs, args.temperature)
        bench_compare.interleave(args, llm, workload, peers, runs)
        cold["decode_share"] = bench_compare.one_stream_share(args, llm, workload, runs["engine"])
    finally:
        llm.close()
        for peer in peers.values():
            peer.close()
    result = {"name": "bench", "config": bc.config_dict(args), "workload": workload.describe(),
              "environment": {**bc.finish_environment(env), "vllm": version, "peer_env": penv},
              "figures": figures(runs, cold, ready, runner, dtype)}
    bc.save_result(args, out_path, result, bench_compare.draw)
    print(table(result), flush=True)
    return result


def figures(runs: dict, cold: dict, ready: dict, runner: str, dtype: str) -> dict:
    f = {"engine": {**bench_engine.summarize_runs(runs["engine"]), "runner": runner, "dtype": dtype, **cold}}
    for mode in ready:
        f[f"vllm_{mode}"] = bench_compare.peer_figures(runs["engine"], runs[mode], ready[mode],
                                                       ("load_s", "first_token_s", "import_s", "torch_threads"))
    bench_compare.add_shares(f)
    return f


def table(result: dict) -> str:
    return bench_compare.table(result, f"vLLM {result['environment']['vllm']}",
                               {"vllm_eager": "vLLM eager", "vllm_compiled": "vLLM compiled"})
