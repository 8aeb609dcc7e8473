"""What the HTTP process and the engine process say to each other, as msgpack maps with explicit fields.

HTTP -> engine:  {"op": "add", "ids", "prompts", "params", "priority", "lora", ["resume"]}   (one request per
                                                                       prompt of token ids, all or none; params
                                                                       {"pooling": {...}}: embedding requests; lora:
                                                                       [name, id, path] or None; resume: per prompt,
                                                                       [[index, token ids, sent chars], ...] of a
                                                                       request taken over from another replica)
                 {"op": "abort", "ids"}
                 {"op": "lora_load" / "lora_unload", "ids": [key], "lora": [name, id, path]}   (answered "accepted")
engine -> HTTP:  {"op": "ready", "model", "max_model_len", "loras",  (first, once the engine is up; loras: the
                  "tokenizer", "sampling_defaults"}                    [name, id, path] of --lora-modules;
                                                                       tokenizer: --tokenizer's path or None;
                                                                       sampling_defaults: --generation-config's)
                 {"op": "accepted", "items": [[first id, error, error type]]}  (per add; error: None, or
                                                                       validation's message)
                 {"op": "outputs", "outputs": [...], "stats": {...}}  (one per step; stats alone when idle, at
                                                                       least every second)
                 {"op": "dead", "why", ["shutdown": true],            (the engine stopped, or the server is
                  ["restart": true]}                                   going away, or this replica restarts
                                                                       and its requests move; nothing more
                                                                       comes)

Sampling parameters travel as their constructor's fields (logit_bias keeps its int keys: maps are unpacked with
any key type; structured_outputs as its fields' map) and are validated once on arrival, by LLM.add_requests;
outputs as their dataclasses' fields,
logprobs as [token id, logprob, rank, decoded token] rows; an embedding as a map {"id", "prompt_token_ids",
"embedding": little-endian float32 bytes}. A request's prompt (text and ids) travels with its first
output only (None in the later ones, which the HTTP side fills in): at one token per step, the prompt would
otherwise be most of every message.
"""
import sys
from array import array
from dataclasses import fields

import msgpack

from nanovllm_tp.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanovllm_tp.pooling.embeddings import EmbeddingOutput, EmbeddingRequestOutput
from nanovllm_tp.pooling.params import PoolingParams
from nanovllm_tp.sampling_params import SamplingParams

_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams) if f.init)
# The "stats" map of an "outputs" message (serving/engine_loop.py scheduler_stats): the scheduler's queues and KV
# usage now, its capacity (max_seqs running at once, kv_blocks in the pool) and lifetime counters. These values
# stand until an engine's first report, and for a stopped one.
KV_MOVED = ("blocks_in", "blocks_out", "bytes_in", "bytes_out")    # an engine's KV transfer counts (kv_transfer.py)
NO_STATS = {"running": 0, "waiting": 0, "max_seqs": 0, "kv_usage": 0.0, "kv_blocks": 0, "preemptions": 0,
            "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": [], "prefix_queries": 0, "prefix_hits": 0,
            **{f"kv_{key}": 0 for key in KV_MOVED}}


def pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(raw) -> dict:
    msg = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    if not isinstance(msg, dict) or not isinstance(msg.get("op"), str):
        raise ValueError("not a message of the serving protocol")
    return msg


def params_to_wire(p: SamplingParams | PoolingParams) -> dict:
    if isinstance(p, PoolingParams):
        return {"pooling": p.to_dict()}
    return {name: (int(v) if name == "output_kind" else v.to_dict() if name == "structured_outputs" and v else v)
            for name in _PARAM_FIELDS for v in (getattr(p, name),)}


def params_from_wire(d: dict) -> SamplingParams | PoolingParams:
    """Unvalidated sampling parameters: the engine validates them when it takes the request (LLM.add_request);
    pooling parameters are checked as they are made."""
    if "pooling" in d:
        return PoolingParams(**d["pooling"])
    return SamplingParams.unvalidated(**d)


def _positions_to_wire(positions):
    if positions is None:
        return None
    return [None if pos is None else [[t, lp.logprob, lp.rank, lp.decoded_token] for t, lp in pos.items()]
            for pos in positions]


def _positions_from_wire(rows):
    if rows is None:
        return None
    return [None if pos is None else {t: Logprob(v, rank, text) for t, v, rank, text in pos} for pos in rows]


def output_to_wire(out: RequestOutput | EmbeddingRequestOutput, with_prompt: bool = True) -> list | dict:
    if isinstance(out, EmbeddingRequestOutput):       # reported once, finished: its prompt ids always travel
        return {"id": out.request_id, "prompt_token_ids": out.prompt_token_ids,
                "embedding": float32_bytes(out.outputs.embedding)}
    m = out.metrics
    return [out.request_id, out.prompt if with_prompt else None, out.prompt_token_ids if with_prompt else None,
            _positions_to_wire(out.prompt_logprobs),
            [[c.index, c.text, c.token_ids, c.cumulative_logprob, _positions_to_wire(c.logprobs), c.finish_reason,
              c.stop_reason, c.error] for c in out.outputs], out.finished,
            None if m is None else [m.arrival_time, m.first_token_time, m.last_token_time, m.finish_time,
                                    m.num_generation_tokens]]


def output_from_wire(row: list | dict) -> RequestOutput | EmbeddingRequestOutput:
    if isinstance(row, dict):
        return EmbeddingRequestOutput(row["id"], EmbeddingOutput(_floats_from_wire(row["embedding"])),
                                      row["prompt_token_ids"])
    request_id, prompt, prompt_ids, prompt_lps, completions, finished, metrics = row
    outs = [CompletionOutput(index, text, ids, cum, _positions_from_wire(lps), reason, stop, error)
            for index, text, ids, cum, lps, reason, stop, error in completions]
    return RequestOutput(request_id, prompt, prompt_ids, _positions_from_wire(prompt_lps), outs, finished,
                         None if metrics is None else RequestMetrics(*metrics))


def float32_bytes(values: list[float]) -> bytes:
    """float32 values as little-endian bytes (a quarter of msgpack's doubles, exact for float32)."""
    packed = array("f", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _floats_from_wire(raw: bytes) -> list[float]:
    packed = array("f")
    packed.frombytes(raw)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()
