"""`bench --compare llamacpp`: the engine against llama.cpp's `llama-server` on the same GGUF file, in the same run.

    python -m nanovllm_tp.bench.throughput --model FILE.gguf --compare llamacpp --peer-bin LLAMA_CPP/build/bin \
        --num-requests 32 --max-model-len 1024 --threads 1 --repeats 3

llama.cpp is an outside build (its bin directory, --peer-bin), never a dependency: this file only starts its
`llama-server` and talks HTTP to it. Order: --model must name a .gguf file and --peer-bin hold a llama-server that
answers --version, both checked before anything loads; then the engine runs the file as it would (quantized by
default; --quantization and --dtype pass through) and yields its first token (cold start), warms up; then
llama-server starts on the same file on a free 127.0.0.1 port with SLOTS = min(--num-requests, --max-num-seqs)
parallel slots of --max-model-len tokens each (-np SLOTS -c SLOTS*max_model_len), the engine's thread count (-t,
-tb) and no prompt cache in host memory (--cache-ram 0); ready once /health answers 200 (load_s), its first token
of one prompt gives first_token_s. Every repeat then sends the engine's prompts, as token ids, to the engine and
to llama-server's native /completion (one request per prompt, all at once: n_predict = the request's output
length, ignore_eos, greedy as temperature 0 and top_k 1, cache_prompt false so no request reuses another's KV,
return_tokens for the generated ids). Output tok/s = requested output tokens / wall time of the whole batch, the
engine's definition. Reported as for vLLM (bench/compare.py): medians, the ratio of the medians and the
median of the per-repeat ratios, greedy agreement, cold start. llama-server is stopped (SIGSTOP) whenever it is
not answering, and ended on every exit path.
"""
from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from nanovllm_tp.bench import common as bc
from nanovllm_tp.launch import serve_process

from nanovllm_tp.bench import compare as bench_compare, engine as bench_engine, peer as bench_peer
SERVER = "llama-server"
PEER_KEY = "llamacpp"


def add_peer_args(parser) -> None:
    g = parser.add_argument_group("comparison with llama.cpp (--compare llamacpp)")
    g.add_argument("--peer-bin", metavar="DIR", help="a llama.cpp build's bin directory holding llama-server")


# =============================================================================================== checks

def check_peer_bin(directory: str | None) -> tuple[str, str]:
    """llama-server's path under `directory` and its version line; ValueError if it is missing or cannot run."""
    if not directory:
        raise ValueError("--compare llamacpp needs --peer-bin DIR (a llama.cpp build's bin directory with "
                         "llama-server)")
    exe = os.path.join(directory, SERVER)
    if not os.path.isfile(exe) or not os.access(exe, os.X_OK):
        raise ValueError(f"--peer-bin {directory}: no executable {SERVER} in it (cmake --build build --target "
                         f"{SERVER})")
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"--peer-bin {directory}: {SERVER} --version did not run ({exc})") from None
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("version:")]
    if out.returncode != 0 or not lines:
        raise ValueError(f"--peer-bin {directory}: {SERVER} --version failed (status {out.returncode})")
    return exe, lines[0].removeprefix("version:").strip()


def check_args(args) -> tuple[str, str]:
    """(llama-server, its version) once --model, the workload and --peer-bin are fit; else SystemExit with why."""
    try:
        if not args.model or not args.model.lower().endswith(".gguf"):
            raise ValueError(f"--compare llamacpp needs --model FILE.gguf (llama.cpp runs GGUF files only), got "
                             f"{args.model!r}")
        if not os.path.isfile(args.model):
            raise ValueError(f"--model {args.model}: no such file")
        longest = args.prompt_len[1] + args.output_len[1]
        if args.max_model_len is not None and longest > args.max_model_len:
            raise ValueError(f"--prompt-len and --output-len allow {longest} tokens, above --max-model-len "
                             f"{args.max_model_len} (each llama-server slot holds max_model_len tokens)")
        return check_peer_bin(args.peer_bin)
    except ValueError as exc:
        raise SystemExit(f"bench: {exc}") from None


def server_shape(num_requests: int, max_num_seqs: int, max_model_len: int) -> tuple[int, int]:
    """llama-server's slots (as many requests at once as the engine may run) and its context, which it splits
    evenly over the slots: max_model_len tokens each."""
    if min(num_requests, max_num_seqs, max_model_len) < 1:
        raise ValueError("requests, max_num_seqs and max_model_len must be >= 1")
    slots = min(num_requests, max_num_seqs)
    return slots, slots * max_model_len


def server_argv(exe: str, model: str, port: int, slots: int, ctx: int, threads: int) -> list[str]:
    return [exe, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-np", str(slots), "-c", str(ctx),
            "-t", str(threads), "-tb", str(threads), "--cache-ram", "0", "--no-webui"]


# =============================================================================================== protocol

def completion_body(prompt: list[int], n_predict: int, temperature: float, seed: int) -> dict:
    """One /completion request: the prompt as token ids (llama-server adds no BOS to those), exactly n_predict
    tokens, no KV reuse; greedy at temperature 0, else plain temperature sampling (no top-k/p, min-p)."""
    bench_peer.token_ids(prompt, "a prompt")
    if type(n_predict) is not int or n_predict < 1:
        raise ValueError(f"n_predict must be an int >= 1, got {n_predict!r}")
    return {"prompt": list(prompt), "n_predict": n_predict, "ignore_eos": True, "temperature": float(temperature),
            "top_k": 1 if temperature == 0 else 0, "top_p": 1.0, "min_p": 0.0, "seed": seed,
            "cache_prompt": False, "return_tokens": True, "stream": False}


def parse_completion(reply: dict) -> list[int]:
    """The generated token ids of one /completion reply; ValueError for an error body or one without ids."""
    if not isinstance(reply, dict):
        raise ValueError(f"{SERVER} replied {str(reply)[:120]!r}, not a JSON object")
    if "error" in reply:
        err = reply["error"]
        raise ValueError(f"{SERVER}: {err.get('message', err) if isinstance(err, dict) else err}")
    tokens = reply.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise ValueError(f"{SERVER} replied without token ids (this build may not know return_tokens): "
                         f"{str(reply)[:120]!r}")
    if reply.get("truncated"):
        raise ValueError(f"{SERVER} truncated a request: its slot's context is too small")
    return tokens


# =============================================================================================== the server

class LlamaServer:
    """llama-server on one GGUF file in a session of its own, stopped (SIGSTOP) except while it answers;
    close() leaves no process behind."""

    def __init__(self, exe: str, model: str, slots: int, ctx: int, threads: int, timeout: float,
                 cold_prompt: list[int]):
        port = serve_process.free_port()
        self.url, self.timeout, self.log = f"http://127.0.0.1:{port}", timeout, tempfile.TemporaryFile("w+")
        self.argv = server_argv(exe, model, port, slots, ctx, threads)
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            serve_process.wait_healthy(self.proc, f"{self.url}/health", SERVER, timeout)
            t1 = time.perf_counter()
            self.ask([cold_prompt], [1], 0.0)
            self.ready = {"load_s": t1 - t0, "first_token_s": time.perf_counter() - t0, "slots": slots,
                          "ctx_size": ctx, "threads": threads, "pid": self.proc.pid}
        except SystemExit as exc:          # it exited or never answered: say what it logged
            tail = self.log_tail()
            self.close()
            raise SystemExit(f"bench: {exc}\n--- its last log lines ---\n{tail}") from None
        except BaseException:
            self.close()
            raise
        bench_compare.signal_group(self.proc, signal.SIGSTOP)

    def _one(self, body: dict) -> list[int]:
        req = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with serve_process.open_local(req, timeout=self.timeout) as resp:
                return parse_completion(json.load(resp))
        except urllib.error.HTTPError as exc:          # an error body: its message
            text = exc.read().decode(errors="replace")
            try:
                return parse_completion(json.loads(text))
            except (ValueError, json.JSONDecodeError) as inner:
                raise RuntimeError(f"{SERVER} answered {exc.code}: {inner}") from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise RuntimeError(f"{SERVER}: {exc}\n--- its last log lines ---\n{self.log_tail()}") from None

    def ask(self, prompts: list[list[int]], max_tokens: list[int], temperature: float) -> list[list[int]]:
        """Every request at once, one HTTP connection each; their generated ids in order."""
        bodies = [completion_body(p, m, temperature, i) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(bodies)) as pool:
            return list(pool.map(self._one, bodies))

    def run(self, prompts, max_tokens, temperature: float) -> dict:
        bench_compare.signal_group(self.proc, signal.SIGCONT)
        try:
            t0 = time.perf_counter()
            token_ids = self.ask(prompts, max_tokens, temperature)
            return {"seconds": time.perf_counter() - t0, "token_ids": token_ids}
        finally:
            bench_compare.signal_group(self.proc, signal.SIGSTOP)

    def log_tail(self, lines: int = 20) -> str:
        self.log.seek(0)
        return "\n".join(self.log.read().splitlines()[-lines:])

    def close(self) -> None:
        bench_compare.signal_group(self.proc, signal.SIGCONT)
        bench_compare.signal_group(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        bench_compare.signal_group(self.proc, signal.SIGKILL)      # any straggler of its session too
        self.proc.wait()
        self.log.close()


# =============================================================================================== run

def main(args) -> dict:
    exe, version = check_args(args)
    bc.apply_threads(args)
    args.model_source = args.model
    from nanovllm_tp.config.engine_config import ModelConfig
    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed, vocab)
    warm_prompts, warm_outs = bc.warmup_prompts(vocab, args.seed)
    llm, cold = bench_compare.cold_engine(args, warm_prompts[-1])
    env, peers, ready = bc.environment(), {}, {}
    out_path = bc.out_path(args, "bench")
    runs = {"engine": [], PEER_KEY: []}
    runner, dtype = llm.engine.runner.describe(), str(llm.engine.dtype).removeprefix("torch.")
    stats = llm.stats()
    try:
        bc.log(args, f"engine ready in {cold['load_s']:.1f}s, first token at {cold['first_token_s']:.1f}s: {runner}")
        bench_engine.warm_up_engine(llm, vocab, args.seed, args.temperature)
        max_model_len = llm.engine.config.max_model_len
        if args.prompt_len[1] + args.output_len[1] > max_model_len:
            raise SystemExit(f"bench: --prompt-len and --output-len allow {args.prompt_len[1] + args.output_len[1]} "
                             f"tokens, above the engine's max_model_len {max_model_len}")
        slots, ctx = server_shape(workload.num_requests, args.max_num_seqs, max_model_len)
        peers[PEER_KEY] = LlamaServer(exe, args.model, slots, ctx, env["torch_threads"], args.peer_timeout,
                                      warm_prompts[-1])
        ready[PEER_KEY] = peers[PEER_KEY].ready
        bc.log(args, f"{SERVER} ready: {slots} slots x {max_model_len} tokens, load {ready[PEER_KEY]['load_s']:.1f}s, "
                     f"first token at {ready[PEER_KEY]['first_token_s']:.1f}s")
        peers[PEER_KEY].run(warm_prompts, warm_outs, args.temperature)
        bench_compare.interleave(args, llm, workload, peers, runs)
        cold["decode_share"] = bench_compare.one_stream_share(args, llm, workload, runs["engine"])
        argv = peers[PEER_KEY].argv
    finally:
        llm.close()
        for peer in peers.values():
            peer.close()
    engine = {**bench_engine.summarize_runs(runs["engine"]), "runner": runner, "dtype": dtype,
              "quantization": stats.get("quantization"), **cold}
    figures = {"engine": engine, PEER_KEY: {**bench_compare.peer_figures(
        runs["engine"], runs[PEER_KEY], ready[PEER_KEY], ("load_s", "first_token_s", "slots", "ctx_size", "threads")),
        "argv": argv}}
    bench_compare.add_shares(figures)
    result = {"name": "bench", "config": bc.config_dict(args), "workload": workload.describe(),
              "environment": {**bc.finish_environment(env), "llama_cpp": version}, "figures": figures}
    bc.save_result(args, out_path, result, bench_compare.draw)
    print(table(result), flush=True)
    return result


def table(result: dict) -> str:
    return bench_compare.table(result, f"llama.cpp {result['environment']['llama_cpp']}", {PEER_KEY: "llama.cpp"})
