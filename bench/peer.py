"""vLLM as a benchmark peer: run with vLLM's own interpreter, driven by JSON lines over stdin and stdout.

    VENV/bin/python path/to/bench/peer.py < commands.jsonl

This file imports only the standard library at the top and vLLM inside main(), so it runs in a virtualenv that has
vLLM and not this package (bench/vllm.py starts it that way). Protocol, one JSON object per line:

  in  1st line  {"op": "config", "model", "dtype", "max_model_len", "enforce_eager", "max_num_seqs",
                 "max_num_batched_tokens", "seed", "cold_prompt": [ids]} and optionally "speculative_config" (vLLM's
                 dict, passed as it is) and "request_times" (true: vLLM keeps per-request timestamps and counters)
  out           {"event": "ready", "import_s", "load_s" (LLM(...) until built), "first_token_s" (LLM(...) until
                 the first token of cold_prompt), "vllm", "torch", "torch_threads", "pid"}
  in  each      {"op": "run", "prompts": [[ids], ...], "max_tokens": [n, ...], "temperature": t, "ignore_eos"}
  out           {"event": "run", "seconds", "tok_s", "token_ids": [[ids], ...]}; with request_times also
                 "decode_s": [last token - first token, per request] and "spec": {"draft", "accepted"} (vLLM's
                 speculative-decoding counters over the run, 0 without speculation)
  in  last      {"op": "quit"}
  out on error  {"event": "error", "message"} (then exit status 1)

Requests run with ignore_eos unless told otherwise, so they yield exactly max_tokens; tok_s = sum(max_tokens)
/ seconds of one generate(). vLLM's own logs (and anything its processes print) go to stderr: stdout carries the
protocol only.
"""
from __future__ import annotations

import json
import os
import sys
import time

# Run as a script, this file's folder comes first on sys.path, and it holds modules named like the ones imported
# here (vllm.py): take it off, so that `import vllm` reaches vLLM.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

CONFIG_FIELDS = {"model": str, "dtype": str, "max_model_len": int, "enforce_eager": bool, "max_num_seqs": int,
                 "max_num_batched_tokens": int, "seed": int, "cold_prompt": list}
OPTIONAL_FIELDS = {"speculative_config": dict, "request_times": bool}
SPEC_COUNTERS = {"draft": "vllm:spec_decode_num_draft_tokens", "accepted": "vllm:spec_decode_num_accepted_tokens"}


def token_ids(value, what: str) -> list[int]:
    """value itself once it is a non-empty list of token ids (ints >= 0); else ValueError naming `what`."""
    if not isinstance(value, list) or not value or not all(type(t) is int and t >= 0 for t in value):
        raise ValueError(f"{what} must be a non-empty list of token ids (ints >= 0)")
    return value


def encode(message: dict) -> str:
    """One protocol line (no newline inside: json.dumps escapes them)."""
    return json.dumps(message, separators=(",", ":"))


def decode_config(line: str) -> dict:
    msg = json.loads(line)
    if not isinstance(msg, dict) or msg.get("op") != "config":
        raise ValueError("the first line must be a config message ({'op': 'config', ...})")
    for name, kind in CONFIG_FIELDS.items():
        if type(msg.get(name)) is not kind:
            raise TypeError(f"config field {name!r} must be {kind.__name__}, got {msg.get(name)!r:.60}")
    for name, kind in OPTIONAL_FIELDS.items():
        if name in msg and type(msg[name]) is not kind:
            raise TypeError(f"config field {name!r} must be {kind.__name__}, got {msg[name]!r:.60}")
    token_ids(msg["cold_prompt"], "cold_prompt")
    return msg


def run_message(prompts: list[list[int]], max_tokens: list[int], temperature: float = 0.0,
                ignore_eos: bool = True) -> dict:
    return {"op": "run", "prompts": [list(p) for p in prompts], "max_tokens": list(max_tokens),
            "temperature": float(temperature), "ignore_eos": bool(ignore_eos)}


def decode_command(line: str) -> dict:
    """A run or quit message, checked: prompts are token-id lists, one max_tokens >= 1 per prompt."""
    msg = json.loads(line)
    if not isinstance(msg, dict) or msg.get("op") not in ("run", "quit"):
        raise ValueError(f"expected a run or quit message, got {line[:80]!r}")
    if msg["op"] == "quit":
        return msg
    prompts, max_tokens = msg.get("prompts"), msg.get("max_tokens")
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("run: prompts must be a non-empty list")
    for i, p in enumerate(prompts):
        token_ids(p, f"run: prompts[{i}]")
    if (not isinstance(max_tokens, list) or len(max_tokens) != len(prompts)
            or not all(type(m) is int and m >= 1 for m in max_tokens)):
        raise ValueError("run: max_tokens must hold one int >= 1 per prompt")
    if type(msg.get("temperature")) not in (int, float) or msg["temperature"] < 0:
        raise ValueError("run: temperature must be a number >= 0")
    if type(msg.setdefault("ignore_eos", True)) is not bool:
        raise ValueError("run: ignore_eos must be true or false")
    return msg


# =============================================================================================== vLLM side

def _generate(llm, msg: dict):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    prompts = [TokensPrompt(prompt_token_ids=p) for p in msg["prompts"]]
    params = [SamplingParams(temperature=msg["temperature"], max_tokens=m, ignore_eos=msg["ignore_eos"], seed=i)
              for i, m in enumerate(msg["max_tokens"])]
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return seconds, outputs


def _spec_counters(llm) -> dict:
    """vLLM's speculative-decoding counters so far (0 where it keeps none)."""
    found = {key: 0 for key in SPEC_COUNTERS}
    for metric in llm.get_metrics():
        for key, name in SPEC_COUNTERS.items():
            if metric.name == name:
                found[key] += int(metric.value)
    return found


def _run(llm, msg: dict, request_times: bool) -> dict:
    before = _spec_counters(llm) if request_times else None
    seconds, outputs = _generate(llm, msg)
    reply = {"event": "run", "seconds": seconds, "tok_s": sum(msg["max_tokens"]) / seconds,
             "token_ids": [list(o.outputs[0].token_ids) for o in outputs]}
    if request_times:
        reply["decode_s"] = [o.metrics.last_token_ts - o.metrics.first_token_ts for o in outputs]
        after = _spec_counters(llm)
        reply["spec"] = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    return reply


def serve(inp, out) -> None:
    def say(message: dict) -> None:
        out.write(encode(message) + "\n")
        out.flush()

    config = decode_config(inp.readline())
    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM
    t1 = time.perf_counter()
    request_times = config.get("request_times", False)
    extra = {"speculative_config": config["speculative_config"]} if config.get("speculative_config") else {}
    llm = LLM(model=config["model"], dtype=config["dtype"], max_model_len=config["max_model_len"],
              enforce_eager=config["enforce_eager"], max_num_seqs=config["max_num_seqs"],
              max_num_batched_tokens=config["max_num_batched_tokens"], seed=config["seed"],
              disable_log_stats=not request_times, **extra)
    t2 = time.perf_counter()
    _generate(llm, run_message([config["cold_prompt"]], [1]))
    t3 = time.perf_counter()
    say({"event": "ready", "import_s": t1 - t0, "load_s": t2 - t1, "first_token_s": t3 - t1,
         "vllm": vllm.__version__, "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
         "pid": os.getpid()})
    for line in inp:
        if not line.strip():
            continue
        msg = decode_command(line)
        if msg["op"] == "quit":
            break
        say(_run(llm, msg, request_times))


def main(serve_lines=None) -> int:
    """Serve the protocol on stdin / stdout with `serve_lines(inp, out)` (vLLM's serve by default; OpenVINO
    GenAI's peer passes its own)."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")      # the protocol's stream
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())      # everything else printed (here or by children): stderr
    try:
        (serve_lines or serve)(sys.stdin, out)
    except Exception as exc:  # noqa: BLE001 - reported to the driver as one line, then a failing exit status
        out.write(encode({"event": "error", "message": f"{type(exc).__name__}: {exc}"}) + "\n")
        out.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
