"""OpenVINO GenAI as a benchmark peer: run with the python of OpenVINO GenAI's own virtualenv, driven by JSON lines
over stdin and stdout, as bench/peer.py drives vLLM (the same run and quit messages, read by that file's
functions: it is loaded by path, so this script needs neither this package nor anything but OpenVINO GenAI).

    VENV/bin/python path/to/bench/openvino_peer.py < commands.jsonl

  in  1st line  {"op": "config", "model" (a directory exported by optimum-cli export openvino), "precision"
                 ("bf16" or "f32": INFERENCE_PRECISION_HINT), "kv_precision" (KV_CACHE_PRECISION), "threads"
                 (INFERENCE_NUM_THREADS), "max_num_seqs", "max_num_batched_tokens", "cache_gib" (the KV cache),
                 "prefix_caching" (false for throughput), "cold_prompt": [ids]}
  out           {"event": "ready", "import_s", "load_s" (the pipeline built), "first_token_s" (until the first
                 token of cold_prompt), "openvino", "openvino_genai", "properties" (the CPU plugin's, as set),
                 "pid"}
  in  each      {"op": "run", "prompts": [[ids], ...], "max_tokens": [n, ...], "temperature": t, "ignore_eos"}
  out           {"event": "run", "seconds", "tok_s", "token_ids": [[ids], ...]}
  in  last      {"op": "quit"}
  out on error  {"event": "error", "message"} (then exit status 1)

One ContinuousBatchingPipeline on the CPU; every request of a run goes to one generate() call as token ids (no
tokenizer on the way), greedy at temperature 0 (else sampled with seed = the request's index), ignoring EOS so it
yields exactly max_tokens. stdout carries the protocol only; anything else printed goes to stderr.
"""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]           # this folder's modules must not shadow the ones imported here

_spec = importlib.util.spec_from_file_location("_bench_peer_protocol",
                                               os.path.join(os.path.dirname(os.path.abspath(__file__)), "peer.py"))
protocol = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(protocol)

CONFIG_FIELDS = {"model": str, "precision": str, "kv_precision": str, "threads": int, "max_num_seqs": int,
                 "max_num_batched_tokens": int, "cache_gib": int, "prefix_caching": bool, "cold_prompt": list}
PRECISIONS = ("bf16", "f32")
KV_PRECISIONS = ("bf16", "f32", "f16", "u8")


def decode_config(line: str) -> dict:
    msg = json.loads(line)
    if not isinstance(msg, dict) or msg.get("op") != "config":
        raise ValueError("the first line must be a config message ({'op': 'config', ...})")
    for name, kind in CONFIG_FIELDS.items():
        if type(msg.get(name)) is not kind:
            raise TypeError(f"config field {name!r} must be {kind.__name__}, got {msg.get(name)!r:.60}")
    if msg["precision"] not in PRECISIONS or msg["kv_precision"] not in KV_PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS} and kv_precision one of {KV_PRECISIONS}")
    if min(msg["threads"], msg["max_num_seqs"], msg["max_num_batched_tokens"], msg["cache_gib"]) < 1:
        raise ValueError("threads, max_num_seqs, max_num_batched_tokens and cache_gib must be >= 1")
    protocol.token_ids(msg["cold_prompt"], "cold_prompt")
    return msg


def properties(config: dict) -> dict:
    """The CPU plugin's properties, every one explicit."""
    return {"INFERENCE_PRECISION_HINT": config["precision"], "KV_CACHE_PRECISION": config["kv_precision"],
            "INFERENCE_NUM_THREADS": config["threads"]}


# =============================================================================================== OpenVINO side

def _generation_config(genai, max_tokens: int, temperature: float, ignore_eos: bool, seed: int):
    gc = genai.GenerationConfig()
    gc.max_new_tokens = max_tokens
    gc.ignore_eos = ignore_eos
    if temperature > 0:
        gc.do_sample, gc.temperature, gc.top_k, gc.top_p, gc.rng_seed = True, temperature, 0, 1.0, seed
    else:
        gc.do_sample = False
    return gc


def _generate(pipe, genai, ov, msg: dict) -> tuple[float, list[list[int]]]:
    import numpy as np
    inputs = [ov.Tensor(np.asarray([p], dtype=np.int64)) for p in msg["prompts"]]
    configs = [_generation_config(genai, m, msg["temperature"], msg["ignore_eos"], i)
               for i, m in enumerate(msg["max_tokens"])]
    t0 = time.perf_counter()
    results = pipe.generate(inputs, configs)
    seconds = time.perf_counter() - t0
    return seconds, [list(r.m_generation_ids[0]) for r in results]


def serve(inp, out) -> None:
    def say(message: dict) -> None:
        out.write(protocol.encode(message) + "\n")
        out.flush()

    config = decode_config(inp.readline())
    t0 = time.perf_counter()
    import openvino as ov
    import openvino_genai as genai
    t1 = time.perf_counter()
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = config["cache_gib"]
    scheduler.max_num_seqs = config["max_num_seqs"]
    scheduler.max_num_batched_tokens = config["max_num_batched_tokens"]
    scheduler.enable_prefix_caching = config["prefix_caching"]
    scheduler.dynamic_split_fuse = True
    pipe = genai.ContinuousBatchingPipeline(config["model"], scheduler, "CPU", properties(config))
    t2 = time.perf_counter()
    _generate(pipe, genai, ov, protocol.run_message([config["cold_prompt"]], [1]))
    t3 = time.perf_counter()
    say({"event": "ready", "import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t1,
         "openvino": ov.get_version(), "openvino_genai": genai.__version__, "properties": properties(config),
         "pid": os.getpid()})
    for line in inp:
        if not line.strip():
            continue
        msg = protocol.decode_command(line)
        if msg["op"] == "quit":
            break
        seconds, token_ids = _generate(pipe, genai, ov, msg)
        say({"event": "run", "seconds": seconds, "tok_s": sum(msg["max_tokens"]) / seconds, "token_ids": token_ids})


if __name__ == "__main__":
    sys.exit(protocol.main(serve))
