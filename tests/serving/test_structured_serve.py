"""Structured outputs and tools through the OpenAI server, driven by the official `openai` client: a pydantic
model through `chat.completions.parse`, response_format json_schema / json_object, vLLM's structured_outputs
field, tool_choice "required" / a named function (arguments validated against the tool's schema, streamed and
not) and "auto" (a Hermes call the model is steered to write); refusals are 400s and the server keeps serving."""
import json
import re
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from tests.serving.test_serve import KEY, client, server, start_server, wait_ready  # noqa: F401 (server: fixture)

pytestmark = pytest.mark.spawn

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"offset": {"type": "integer", "minimum": -12,
                                                                                   "maximum": 14}},
                                       "required": ["offset"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Pet(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog"]
    tags: list[Literal["a", "b"]] = Field(max_length=2)


def post(port: int, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1{path}", json={"model": "tiny", **body},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120)


def test_parse_with_a_pydantic_model_returns_the_parsed_object(server):
    c = client(server)
    for parse in (c.chat.completions.parse, c.beta.chat.completions.parse):
        done = parse(model="tiny", messages=ASK, response_format=Pet, max_tokens=200, temperature=0.8, seed=3)
        pet = done.choices[0].message.parsed
        assert isinstance(pet, Pet) and done.choices[0].finish_reason == "stop"
        assert pet == Pet.model_validate_json(done.choices[0].message.content)


class GetWeather(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["celsius", "fahrenheit"]


def test_parse_with_a_pydantic_function_tool_returns_parsed_arguments(server):
    import openai
    done = client(server).chat.completions.parse(model="tiny", messages=ASK, max_tokens=120,
                                                  tools=[openai.pydantic_function_tool(GetWeather)],
                                                  tool_choice="required", temperature=1.0, seed=2)
    call = done.choices[0].message.tool_calls[0]
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


def test_response_format_and_structured_outputs_constrain_both_endpoints(server):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = post(server, "/chat/completions", {"messages": ASK, "max_tokens": 60, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    r = post(server, "/completions", {"prompt": "Pick:", "max_tokens": 20, "temperature": 1.0, "n": 3, "seed": 1,
                                      "structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.status_code == 200 and {c["text"] for c in r.json()["choices"]} <= {"red", "green", "blue"}
    r = post(server, "/completions", {"prompt": "Code:", "max_tokens": 20,
                                      "structured_outputs": {"regex": "[A-F]{3}-[0-9]{2}"}})
    assert re.fullmatch("[A-F]{3}-[0-9]{2}", r.json()["choices"][0]["text"])
    r = post(server, "/completions", {"prompt": "Obj:", "max_tokens": 30, "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"].lstrip().startswith("{")


def check_calls(calls, names=None):
    assert calls, "no tool calls"
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({call.id for call in calls}) == len(calls)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_forced_tool_calls_validate_against_the_tool_schema(server, tool_choice):
    c = client(server)
    names = None if tool_choice == "required" else {"get_time"}
    done = c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                                     max_tokens=200, temperature=1.0, seed=5)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls, names)
    calls, finish = {}, None
    for chunk in c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], stream=True,
                                           tool_choice=tool_choice, max_tokens=200, temperature=1.0, seed=5):
        delta = chunk.choices[0].delta
        assert not delta.content
        for d in delta.tool_calls or ():
            if d.id is not None:
                calls[d.index] = [d.id, d.function.name, ""]
            calls[d.index][2] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    streamed = [(name, json.loads(args)) for _, name, args in calls.values()]
    assert streamed == [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]


def test_auto_reads_the_hermes_call_the_model_wrote(server):
    """The model is steered (vLLM's structured_outputs body field) to write a Hermes call: auto reads it."""
    steer = {"regex": r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
                      r'"unit": "celsius"\}\}\n</tool_call>'}
    c = client(server)
    done = c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=60,
                                     extra_body={"structured_outputs": steer})
    assert done.choices[0].finish_reason == "tool_calls"
    check_calls(done.choices[0].message.tool_calls, {"get_weather"})
    stream = c.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, CLOCK], max_tokens=60, stream=True,
                                       extra_body={"structured_outputs": steer})
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    assert not any(d.content for d in deltas)
    calls = [t for d in deltas for t in d.tool_calls or ()]
    assert len(calls) == 1 and calls[0].function.arguments == done.choices[0].message.tool_calls[0].function.arguments


@pytest.mark.parametrize("body, match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs a 'schema' object"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format and structured_outputs both constrain"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "look-around"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope'"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "both constrain"),
])
def test_refusals_are_400s_naming_the_problem_and_the_server_keeps_serving(server, body, match):
    r = post(server, "/chat/completions", {"messages": ASK, "max_tokens": 8, **body})
    assert r.status_code == 400 and re.search(match, r.json()["error"]["message"]), r.text
    r = post(server, "/chat/completions", {"messages": ASK, "max_tokens": 4})
    assert r.status_code == 200


@pytest.mark.slow
def test_a_compile_past_the_time_limit_is_a_400(tiny_model_dir):
    port, ctx = start_server(tiny_model_dir, "--api-key", KEY, "--grammar-compile-timeout", "1e-9")
    with ctx as proc:
        wait_ready(port, proc)
        r = post(port, "/chat/completions", {"messages": ASK, "max_tokens": 8,
                                             "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and "did not compile within the time limit" in r.json()["error"]["message"]
        assert post(port, "/chat/completions", {"messages": ASK, "max_tokens": 4}).status_code == 200
