"""Structured outputs against a careful client, through the OpenAI server: tools whose parameters use $defs and
"#" under tool_choice "required", duplicate tool names, constraints that accept nothing (refused at compile time),
grammars that fail while generating (finish_reason "abort" with the reason in the body and the stream), and
compiles that must not starve one another (a small constraint beside huge ones; a timeout is no verdict)."""
import json
import threading
import time

import httpx
import jsonschema
import pytest

from nanovllm_tp.serving.tool_calls import ToolMode
from tests.helpers import GGUF, smollm2
from tests.serving.test_serve import KEY, client, server, start_server, wait_ready  # noqa: F401 (server: fixture)
from tests.serving.test_structured_serve import ASK, post

pytestmark = pytest.mark.spawn

LOC = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                        "zone": {"enum": ["north", "south"]}},
       "required": ["city", "zone"], "additionalProperties": False}
# pydantic's shape: the nested model under $defs, referred to from the tool's own parameters
FIND = {"type": "function", "function": {"name": "find", "parameters": {
    "$defs": {"Loc": LOC}, "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}},
    "required": ["loc"], "additionalProperties": False}}}
# "#" is the tool's own parameters: a tree of nodes, never the array of calls around them
TREE = {"type": "function", "function": {"name": "tree", "parameters": {
    "type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["v", "next"], "additionalProperties": False}}}
# A row of more alternatives than the parser's limit (2,000), reached only after a first character that is not
# forced: the compile's probe of the output's start cannot see it, generation hits it
WIDE_LATER = 'start: ("x" | "y") wide\nwide: ' + " | ".join(f'"w{i}"' for i in range(2500))


def test_required_tools_resolve_refs_within_their_own_parameters(server):
    """pydantic's $defs in a tool's parameters work under "required" as they do for a named tool; "#" in a tool
    means its own parameters (checked on the schema the output is held to: a random model seldom ends a tree)."""
    done = client(server).chat.completions.create(model="tiny", messages=ASK, tools=[FIND, TREE],
                                                  tool_choice="required", parallel_tool_calls=False,
                                                  max_tokens=300, temperature=1.0, seed=4)
    calls = done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (FIND, TREE)}
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])
    required = ToolMode([FIND["function"], TREE["function"]], "required").schema()
    node = {"v": 1, "next": {"v": 2, "next": None}}
    jsonschema.validate([{"name": "tree", "parameters": node}], required)
    with pytest.raises(jsonschema.ValidationError):       # "#" once meant the array of calls itself
        jsonschema.validate([{"name": "tree", "parameters": {"v": 1, "next": [{"name": "tree", "parameters": node}]}}],
                            required)


def test_duplicate_tool_names_are_a_400(server):
    other = {"type": "function", "function": {"name": "find", "parameters": {"type": "object"}}}
    for choice in ("auto", "required", {"type": "function", "function": {"name": "find"}}):
        r = post(server, "/chat/completions", {"messages": ASK, "max_tokens": 8, "tools": [FIND, other],
                                               "tool_choice": choice})
        assert r.status_code == 400 and "'find' is given to more than one tool" in r.json()["error"]["message"]
    assert post(server, "/chat/completions", {"messages": ASK, "max_tokens": 4}).status_code == 200


CYCLE = {"$defs": {"A": {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"]}},
         "$ref": "#/$defs/A"}


@pytest.mark.parametrize("constraint, match", [
    ({"structured_outputs": {"regex": r"[^\s\S]"}}, "accepts no output at all"),
    ({"structured_outputs": {"grammar": "root ::= root"}}, "accepts no output at all"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CYCLE}}},
     "accepts no finite JSON value"),
    ({"structured_outputs": {"grammar": 'start: "a" start'}}, "limits were hit at the start of the output"),
    ({"structured_outputs": {"grammar": "start: " + " | ".join(f'"w{i}x"' for i in range(3000))}},
     "Current row has 3001 items"),
], ids=["empty-regex", "gbnf-loop", "json-cycle", "lark-endless", "wide-row"])
def test_a_constraint_that_accepts_nothing_or_hits_a_limit_at_once_is_a_400(server, constraint, match):
    r = post(server, "/chat/completions", {"messages": ASK, "max_tokens": 8, **constraint})
    assert r.status_code == 400 and match in r.json()["error"]["message"], r.text
    assert post(server, "/chat/completions", {"messages": ASK, "max_tokens": 4}).status_code == 200


def test_a_grammar_that_fails_while_generating_aborts_with_its_reason(server):
    body = {"messages": ASK, "max_tokens": 16, "temperature": 1.0, "seed": 1, "n": 2,
            "structured_outputs": {"grammar": WIDE_LATER}}
    r = post(server, "/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert {c["finish_reason"] for c in out["choices"]} == {"abort"}
    error = out["error"]
    assert error["code"] == 400 and error["param"] == "structured_outputs"
    assert "choice 0: the grammar backend's limits were hit at output token 1" in error["message"]
    assert "choice 1:" in error["message"] and "Current row has" in error["message"]
    events = []
    with httpx.stream("POST", f"http://127.0.0.1:{server}/v1/chat/completions", timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", **body, "n": 1, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    finish = [c["finish_reason"] for e in events for c in e.get("choices", ()) if c.get("finish_reason")]
    assert finish == ["abort"] and "Current row has" in events[-1]["error"]["message"]
    assert post(server, "/chat/completions", {"messages": ASK, "max_tokens": 4}).status_code == 200


def huge_grammar(tag: str, n: int) -> dict:
    """A Lark rule of n alternatives: seconds to build (and refused once built: the parser takes rows of at most
    2,000)."""
    return {"grammar": "start: " + " | ".join(f'"{tag}{i}"' for i in range(n))}


def medium_choice() -> dict:
    """Past the small lane's size, quick to compile."""
    return {"choice": [f"m{i}" for i in range(3000)]}


@pytest.mark.slow
def test_a_small_constraint_is_not_stuck_behind_huge_ones_and_a_timeout_is_no_verdict(tiny_model_dir):
    """Three huge grammars (seconds each to build) and a small choice: the small one compiles at once. A medium
    one queued behind the huge ones times out, and compiles when asked again (the timeout was that request's)."""
    port, ctx = start_server(tiny_model_dir, "--api-key", KEY, "--grammar-compile-timeout", "3")
    with ctx as proc:
        wait_ready(port, proc)
        answers = {}

        def ask(name, constraint, max_tokens=4):
            start = time.monotonic()
            r = post(port, "/completions", {"prompt": "Pick:", "max_tokens": max_tokens,
                                            "structured_outputs": constraint})
            answers.setdefault(name, []).append((r.status_code, r.text, time.monotonic() - start))

        huge = [threading.Thread(target=ask, args=(f"huge{k}", huge_grammar("abc"[k], 85000))) for k in range(3)]
        for t in huge:
            t.start()
        time.sleep(0.5)
        medium = threading.Thread(target=ask, args=("medium", medium_choice()))
        medium.start()
        ask("small", {"choice": ["yes", "no"]})
        for t in (*huge, medium):
            t.join()
        assert answers["small"][0][0] == 200, answers["small"]        # within its 3 s, beside the huge ones
        assert all(a[0][0] == 400 for k, a in answers.items() if k != "small"), answers     # (a timeout, or
        assert "within the time limit" in answers["medium"][0][1], answers["medium"]    # the row limit once built)
        deadline = time.monotonic() + 120
        while answers["medium"][-1][0] != 200 and time.monotonic() < deadline:
            ask("medium", medium_choice())       # the huge compile that ran on may still hold the lane
        assert answers["medium"][-1][0] == 200, answers["medium"]
        second = answers["medium"][1]         # compiled, or waited its own 3 s: the first timeout was not kept
        assert second[0] == 200 or second[2] > 2.5, second


# SmolLM2 under schemas a small model runs past when objects stay open: it writes one more property, then another
ACCOUNT = {"type": "object", "properties": {"id": {"type": "integer"}, "username": {"type": "string"},
                                            "active": {"type": "boolean"}},
           "required": ["id", "username", "active"]}
MOVIE = {"type": "object", "properties": {
    "title": {"type": "string"}, "rating": {"type": "number", "minimum": 0, "maximum": 10},
    "review": {"type": "object", "properties": {"verdict": {"enum": ["watch", "skip"]}}, "required": ["verdict"]}},
    "required": ["title", "rating", "review"]}
CITY = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"]}
LOOKUP = {"type": "function", "function": {"name": "lookup_city", "description": "Facts about a city",
                                           "parameters": CITY}}


@pytest.mark.slow
@smollm2
def test_smollm2_answers_end_valid_under_schemas_and_a_named_tool_stream():
    port, ctx = start_server(GGUF, "--api-key", KEY, "--kv-cache-memory", str(256 << 20), "--max-model-len", "1024")
    cases = [("Describe a user account as JSON.", ACCOUNT), ("Rate the movie Alien as JSON.", MOVIE),
             ("Describe Paris as JSON.", CITY)]
    with ctx as proc:
        wait_ready(port, proc, timeout=300)
        bad = []
        for prompt, schema in cases:
            for seed in (1, 2, 3):
                r = post(port, "/chat/completions", {
                    "messages": [{"role": "user", "content": prompt}], "max_tokens": 200, "temperature": 0.8,
                    "seed": seed, "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                                             "schema": schema}}})
                choice = r.json()["choices"][0]
                try:
                    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
                    assert choice["finish_reason"] == "stop"
                except (ValueError, AssertionError, jsonschema.ValidationError):
                    bad.append((prompt, seed, choice["finish_reason"], choice["message"]["content"][-80:]))
        c = client(port)
        for seed in (1, 2, 3):
            args, finish = "", None
            for chunk in c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "Tell me about Lyon."}], tools=[LOOKUP],
                    tool_choice={"type": "function", "function": {"name": "lookup_city"}}, stream=True,
                    max_tokens=200, temperature=0.8, seed=seed):
                for d in chunk.choices[0].delta.tool_calls or ():
                    args += d.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            try:
                jsonschema.validate(json.loads(args), CITY)
                assert finish == "tool_calls"
            except (ValueError, AssertionError, jsonschema.ValidationError):
                bad.append(("tool", seed, finish, args[-80:]))
        assert not bad, bad
