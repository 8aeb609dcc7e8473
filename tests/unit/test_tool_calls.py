"""Tool calls on the server's side, without a model: the schemas tool_choice enforces (checked with jsonschema),
the reading of Hermes and Llama 3 calls, and streams whose delta.tool_calls rebuild what the whole answer holds."""
import json

import jsonschema
import pytest

from nanovllm_tp.serving.tool_calls import ToolMode, parse_auto, scan_calls

WEATHER = {"name": "get_weather", "description": "weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"enum": ["c", "f"]}}, "required": ["city"]}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}


def replay(mode: ToolMode, text: str, size: int):
    """Feed text in pieces of `size` characters: (content, {index: [id, name, arguments]})."""
    streamer, content, calls = mode.streamer(), "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for k, piece in enumerate(pieces):
        delta, tool_deltas = streamer.feed(piece, k == len(pieces) - 1)
        content += delta
        for d in tool_deltas:
            if "id" in d:
                assert d["index"] not in calls and d["type"] == "function"
                calls[d["index"]] = [d["id"], d["function"]["name"], ""]
            calls[d["index"]][2] += d["function"]["arguments"]
    return content, calls


def test_required_and_named_schemas_accept_calls_and_refuse_others():
    required = ToolMode([WEATHER, TIME], "required").schema()
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "get_time", "parameters": {}}], required)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "nope", "parameters": {}}],
                [{"name": "get_time", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, required)
    single = ToolMode([WEATHER, TIME], "required", parallel=False).schema()
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, single)
    assert ToolMode([WEATHER, TIME], "named", "get_time").schema() == TIME["parameters"]
    assert ToolMode([WEATHER], "auto").schema() is None and ToolMode([WEATHER], "none").schema() is None


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_required_streams_rebuild_the_whole_answer(size):
    mode = ToolMode([WEATHER, TIME], "required")
    text = ('[{"name": "get_weather", "parameters": {"city": "Pa\\"ris {[", "unit": "c"}},\n'
            ' {"parameters": {"tz": "UTC"}, "name": "get_time"}]')
    content, calls = replay(mode, text, size)
    whole = mode.parse(text)
    assert content == "" and whole[0] is None
    assert [(c[1], c[2]) for c in calls.values()] == whole[1]
    assert [json.loads(c[2]) for c in calls.values()] == [{"city": 'Pa"ris {[', "unit": "c"}, {"tz": "UTC"}]
    assert len({c[0] for c in calls.values()}) == 2 and all(c[0].startswith("call_") for c in calls.values())


def test_named_streams_the_output_as_arguments():
    mode = ToolMode([WEATHER], "named", "get_weather")
    content, calls = replay(mode, '{"city": "Rome"}', 2)
    assert calls[0][1:] == ["get_weather", '{"city": "Rome"}'] and content == ""


@pytest.mark.parametrize("text, content, calls", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>', None,
     [("get_weather", '{"city": "Oslo"}')]),
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>\n'
     '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}', "Let me check.",
     [("get_weather", '{"city": "A"}'), ("get_time", '{"tz": "UTC"}')]),             # unclosed last, string args
    ('<|python_tag|>{"name": "get_time", "parameters": {"tz": "CET"}}', None, [("get_time", '{"tz": "CET"}')]),
    ('{"name": "get_weather", "parameters": {"city": "B"}}; {"name": "get_time", "parameters": {}}', None,
     [("get_weather", '{"city": "B"}'), ("get_time", "{}")]),
    ('{"name": "unknown_tool", "parameters": {}}', '{"name": "unknown_tool", "parameters": {}}', []),
    ('<tool_call>{"name": "get_weather", "arguments": {broken</tool_call>', None, []),
    ("It is sunny in Oslo.", "It is sunny in Oslo.", []),
])
def test_auto_reads_hermes_and_llama_calls(text, content, calls):
    got_content, got_calls = parse_auto(text, {"get_weather", "get_time"})
    assert got_calls == calls
    assert got_content == (content if calls or content is not None else text)


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_auto_streams_content_then_whole_calls(size):
    mode = ToolMode([WEATHER, TIME], "auto")
    text = 'Checking <now>.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = replay(mode, text, size)
    assert content.strip() == "Checking <now>." and "<tool_call" not in content
    assert [(c[1], c[2]) for c in calls.values()] == [("get_weather", '{"city": "Oslo"}')]
    plain = "A plain answer that mentions <tool but never calls one."
    content, calls = replay(mode, plain, size)
    assert content == plain and not calls


def test_scan_calls_follows_a_partial_array():
    calls = scan_calls('[{"name": "get_weather", "parameters": {"city": "Os')
    assert calls[0].name == "get_weather" and calls[0].args == '{"city": "Os' and not calls[0].args_done
