"""`bench --compare openvino`: the engine against OpenVINO GenAI (from its own virtualenv) in the same run.

    python -m nanovllm_tp.bench.throughput --model HF_DIR --dtype bfloat16 --compare openvino \
        --peer-python VENV/bin/python --peer-weight-format fp32 --num-requests 32 --max-model-len 1024 --repeats 3

OpenVINO GenAI is never imported here, nor a dependency: its virtualenv (`pip install openvino-genai
"optimum-intel[openvino]" nncf`) is named by --peer-python, by default $NANOVLLM_TP_OPENVINO_PYTHON. Order: that
python must import openvino_genai and --model be a HF directory (or --peer-model one of --model's shape: the
engine then runs --model, a GGUF file of the same weights, and OpenVINO the directory), checked before anything
loads; the directory is exported once with that virtualenv's `optimum-cli export openvino --task
text-generation-with-past --weight-format fp32|int8|int4` (`--group-size 64` for int4 where the hidden or MLP size
is not a multiple of 128)
and kept in the cache (a second run reuses it); the engine is built, yields its first token (cold start), warms
up; then bench/openvino_peer.py starts under that python with one ContinuousBatchingPipeline on the CPU:
INFERENCE_PRECISION_HINT bf16 or f32 as the engine's dtype, KV_CACHE_PRECISION as the engine's KV (its dtype, or
u8 for int8), INFERENCE_NUM_THREADS the engine's thread count, the engine's max_num_seqs and
max_num_batched_tokens, --peer-kv-gib of KV, prefix caching off. Every repeat runs the engine and the peer on the
same freshly drawn token-id prompts, interleaved; greedy, EOS ignored. Reported as for vLLM (bench/compare.py):
medians, the ratio of the medians and the median of the per-repeat ratios, greedy agreement, cold start; the
peer is stopped (SIGSTOP) whenever it is not answering.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import subprocess

from nanovllm_tp import envs
from nanovllm_tp.bench import common as bc
from nanovllm_tp.bench import compare as bench_compare, engine as bench_engine
from nanovllm_tp.bench import openvino_peer as ov_peer
from nanovllm_tp.bench.vllm import PeerProcess

PEER_SCRIPT = pathlib.Path(ov_peer.__file__)
PEER_KEY = "openvino"
WEIGHT_FORMATS = ("fp32", "int8", "int4")
PRECISION = {"bfloat16": "bf16", "float32": "f32"}
KV_PRECISION = {"int8": "u8"}                 # kv_cache_dtype -> KV_CACHE_PRECISION; "auto": the engine's dtype


def add_peer_args(parser) -> None:
    g = parser.add_argument_group("comparison with OpenVINO GenAI (--compare openvino; --peer-python, "
                                  "--peer-kv-gib and --peer-timeout as for vLLM)")
    g.add_argument("--peer-weight-format", choices=WEIGHT_FORMATS, default="fp32",
                   help="optimum-cli export openvino --weight-format (fp32 keeps the weights; int8 / int4 compress "
                        "them)")
    g.add_argument("--peer-model", metavar="HF_DIR",
                   help="the Hugging Face directory OpenVINO exports (default: --model), so that the engine can run "
                        "a GGUF file of the same model, e.g. make-shape's directory beside its Q4_K_M file; its "
                        "shape must be --model's")


# =============================================================================================== checks

def peer_python(args) -> str | None:
    return args.peer_python or envs.get("NANOVLLM_TP_OPENVINO_PYTHON")


def check_peer_python(path: str | None) -> dict:
    """The versions under `path` ({"openvino", "openvino_genai", "optimum_intel"}); ValueError if the interpreter is
    missing or cannot import OpenVINO GenAI, or its virtualenv has no optimum-cli."""
    if not path:
        raise ValueError("--compare openvino needs --peer-python PATH or NANOVLLM_TP_OPENVINO_PYTHON (the python of "
                         "a virtualenv with openvino-genai and optimum-intel[openvino])")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise ValueError(f"--peer-python {path}: no such executable file")
    code = ("import json, importlib.metadata as m, openvino_genai;"
            "print(json.dumps({k: m.version(p) for k, p in (('openvino', 'openvino'), ('openvino_genai', "
            "'openvino-genai'), ('optimum_intel', 'optimum-intel'))}))")
    try:
        out = subprocess.run([path, "-c", code], capture_output=True, text=True, timeout=600, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"--peer-python {path}: could not run it ({exc})") from None
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ValueError(f"--peer-python {path} cannot import openvino_genai (or lacks optimum-intel): {last}")
    if not os.access(optimum_cli(path), os.X_OK):
        raise ValueError(f"--peer-python {path}: no optimum-cli beside it (pip install 'optimum-intel[openvino]')")
    return json.loads(out.stdout.strip().splitlines()[-1])


def optimum_cli(python: str) -> str:
    return os.path.join(os.path.dirname(python), "optimum-cli")


SHAPE_FACTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim")


def peer_source(args) -> str | None:
    """The Hugging Face directory OpenVINO exports: --peer-model, else --model (None: a preset, resolved later).
    ValueError where it is no such directory, or --peer-model's shape is not --model's."""
    source = args.peer_model or args.model
    if source and not os.path.isfile(os.path.join(source, "config.json")):
        flag = "--peer-model" if args.peer_model else "--model"
        raise ValueError(f"--compare openvino needs {flag} to be a Hugging Face directory (config.json), got "
                         f"{source!r}; nanovllm-tp convert MODEL.gguf DIR makes one, or give --peer-model DIR")
    if args.peer_model:
        if not args.model:
            raise ValueError("--peer-model needs --model: the engine's checkpoint of the same shape")
        from nanovllm_tp.config.model_config import ModelConfig
        ours, theirs = ModelConfig.from_pretrained(args.model), ModelConfig.from_pretrained(source)
        differ = [f"{k} {getattr(ours, k, None)} against {getattr(theirs, k, None)}" for k in SHAPE_FACTS
                  if getattr(ours, k, None) != getattr(theirs, k, None)]
        if differ:
            raise ValueError(f"--peer-model {source!r} is not --model's shape: {'; '.join(differ)}")
    return source


def check_args(args) -> tuple[str, dict]:
    """(the peer's python, its versions) once it and the model it exports are fit; else SystemExit with why."""
    python = peer_python(args)
    try:
        versions = check_peer_python(python)
        peer_source(args)
    except ValueError as exc:
        raise SystemExit(f"bench: {exc}") from None
    return python, versions


# =============================================================================================== export

def export_argv(python: str, model: str, weight_format: str, out_dir: str) -> list[str]:
    """optimum-cli's command line: int4 in groups of 64 where the hidden or MLP size is not a multiple of 128."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    argv = [optimum_cli(python), "export", "openvino", "--model", str(model), "--task", "text-generation-with-past",
            "--weight-format", weight_format]
    if weight_format == "int4" and any(config[k] % 128 for k in ("hidden_size", "intermediate_size")):
        argv += ["--group-size", "64"]
    return argv + [str(out_dir)]


def exported(python: str, model: str, weight_format: str, versions: dict, timeout: float) -> pathlib.Path:
    """The OpenVINO IR of `model` in `weight_format`, exported once and kept in the cache (keyed by the model
    directory, its files' sizes and dates, the format and the peer's versions)."""
    from nanovllm_tp.launch.make_tiny import cached_build
    model = os.path.abspath(model)
    files = sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in pathlib.Path(model).iterdir()
                   if p.is_file())
    key = json.dumps([model, files, weight_format, versions]).encode()
    name = f"openvino-{pathlib.Path(model).name}-{weight_format}-{hashlib.sha256(key).hexdigest()[:16]}"

    def build(directory: pathlib.Path) -> None:
        argv = export_argv(python, model, weight_format, str(directory))
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
        if out.returncode != 0 or not (directory / "openvino_model.xml").is_file():
            tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-15:])
            raise SystemExit(f"bench: {' '.join(argv)} failed (status {out.returncode}):\n{tail}")
    return cached_build(name, build)


# =============================================================================================== run

def peer_config(llm, args, model_dir: pathlib.Path, threads: int, cold_prompt: list[int]) -> dict:
    dtype = str(llm.engine.dtype).removeprefix("torch.")
    if dtype not in PRECISION:
        raise SystemExit(f"bench: --compare openvino runs the engine's dtype as INFERENCE_PRECISION_HINT, bf16 or f32; "
                         f"the engine runs {dtype}")
    kv = llm.engine.config.kv_cache_dtype
    if kv != "auto" and kv not in KV_PRECISION:
        raise SystemExit(f"bench: --compare openvino has no KV_CACHE_PRECISION for --kv-cache-dtype {kv}")
    return {"model": str(model_dir), "precision": PRECISION[dtype], "kv_precision": KV_PRECISION.get(kv,
            PRECISION[dtype]), "threads": threads, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "cache_gib": args.peer_kv_gib,
            "prefix_caching": False, "cold_prompt": cold_prompt}


def main(args) -> dict:
    python, versions = check_args(args)
    bc.apply_threads(args)
    args.model_source = args.model or f"preset {args.preset}"
    args.model = bc.resolve_model(args)
    source = peer_source(args)
    model_dir = exported(python, source, args.peer_weight_format, versions, args.peer_timeout)
    vocab = bc.model_vocab_size(args.model)
    workload = bc.make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), args.seed, vocab)
    warm_prompts, warm_outs = bc.warmup_prompts(vocab, args.seed)
    llm, cold = bench_compare.cold_engine(args, warm_prompts[-1])
    env, peers, ready = bc.environment(), {}, {}
    out_path = bc.out_path(args, "bench")
    runs = {"engine": [], PEER_KEY: []}
    runner, dtype = llm.engine.runner.describe(), str(llm.engine.dtype).removeprefix("torch.")
    try:
        bc.log(args, f"engine ready in {cold['load_s']:.1f}s, first token at {cold['first_token_s']:.1f}s: {runner}")
        bench_engine.warm_up_engine(llm, vocab, args.seed, args.temperature)
        config = peer_config(llm, args, model_dir, env["torch_threads"], warm_prompts[-1])
        peers[PEER_KEY] = PeerProcess(python, config, {}, args.peer_timeout, PEER_SCRIPT, "OpenVINO GenAI")
        ready[PEER_KEY] = peers[PEER_KEY].ready
        bc.log(args, f"OpenVINO GenAI ready: load {ready[PEER_KEY]['load_s']:.1f}s, first token at "
                     f"{ready[PEER_KEY]['first_token_s']:.1f}s, {ready[PEER_KEY]['properties']}")
        peers[PEER_KEY].run(warm_prompts, warm_outs, args.temperature)
        bench_compare.interleave(args, llm, workload, peers, runs)
        cold["decode_share"] = bench_compare.one_stream_share(args, llm, workload, runs["engine"])
    finally:
        llm.close()
        for peer in peers.values():
            peer.close()
    figures = {"engine": {**bench_engine.summarize_runs(runs["engine"]), "runner": runner, "dtype": dtype, **cold},
               PEER_KEY: {**bench_compare.peer_figures(runs["engine"], runs[PEER_KEY], ready[PEER_KEY],
                                                       ("load_s", "first_token_s", "import_s", "properties")),
                          "weight_format": args.peer_weight_format, "exported": str(model_dir),
                          "export_argv": export_argv(python, source, args.peer_weight_format, str(model_dir))}}
    bench_compare.add_shares(figures)
    result = {"name": "bench", "config": bc.config_dict(args), "workload": workload.describe(),
              "environment": {**bc.finish_environment(env), **versions}, "figures": figures}
    bc.save_result(args, out_path, result, bench_compare.draw)
    print(table(result), flush=True)
    return result


def table(result: dict) -> str:
    e = result["environment"]
    return bench_compare.table(result, f"OpenVINO GenAI {e['openvino_genai']}",
                               {PEER_KEY: f"OpenVINO GenAI {result['figures'][PEER_KEY]['weight_format']}"})
