"""The Responses API (POST /v1/responses) through the official `openai` client against a real server: the answer
is the chat path's (greedy text and usage equal /v1/chat/completions' for the same messages), streamed as OpenAI's
semantic events in order, cut by max_output_tokens as "incomplete", continued by previous_response_id, with
function tools as function_call items; what is not implemented is refused by name; /ping is /health."""
import json

import httpx
import openai
import pytest

from tests.serving.test_serve import KEY, client, server, start_server, wait_ready  # noqa: F401 (server: fixture)

pytestmark = pytest.mark.spawn

CLOCK = {"type": "function", "name": "get_time", "description": "The time now",
         "parameters": {"type": "object", "properties": {"offset": {"type": "integer", "minimum": -12,
                                                                    "maximum": 14}},
                        "required": ["offset"], "additionalProperties": False}}
CHAT_CLOCK = {"type": "function", "function": {k: v for k, v in CLOCK.items() if k != "type"}}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


def chat(c, messages, **kw):
    return c.chat.completions.create(model="tiny", messages=messages, temperature=0, **kw)


def post(port: int, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}{path}", json=body, headers={"Authorization": f"Bearer {key}"},
                      timeout=120)


def test_ping_answers_as_health_without_a_key(server):
    for method in ("GET", "POST"):
        got = httpx.request(method, f"http://127.0.0.1:{server}/ping", timeout=10)
        assert got.status_code == 200 == httpx.get(f"http://127.0.0.1:{server}/health", timeout=10).status_code


def test_the_answer_is_the_chat_answer_greedy(server):
    c = client(server)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello, who are you?"}]
    want = chat(c, messages, max_tokens=24)
    got = c.responses.create(model="tiny", instructions="Answer briefly.", input="Hello, who are you?",
                             temperature=0, max_output_tokens=24)
    assert got.object == "response" and got.model == "tiny" and got.id.startswith("resp_")
    assert got.output_text == want.choices[0].message.content
    [item] = got.output
    assert item.type == "message" and item.role == "assistant" and [p.type for p in item.content] == ["output_text"]
    assert (got.usage.input_tokens, got.usage.output_tokens, got.usage.total_tokens) == \
        (want.usage.prompt_tokens, want.usage.completion_tokens, want.usage.total_tokens)
    status = "incomplete" if want.choices[0].finish_reason == "length" else "completed"
    assert got.status == status
    # the same messages as items, with input_text parts: the same prompt, the same answer
    items = [{"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Answer briefly."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Hello, "},
                                          {"type": "input_text", "text": "who are you?"}]}]
    again = c.responses.create(model="tiny", input=items, temperature=0, max_output_tokens=24)
    assert again.output_text == got.output_text and again.usage.input_tokens == got.usage.input_tokens


def test_max_output_tokens_ends_incomplete(server):
    got = client(server).responses.create(model="tiny", input="Tell me a long story.", temperature=0,
                                          max_output_tokens=3)
    assert got.status == "incomplete" and got.incomplete_details.reason == "max_output_tokens"
    assert got.usage.output_tokens == 3 and got.output[0].status == "incomplete"


def test_streamed_events_arrive_in_order_and_make_the_answer(server):
    c = client(server)
    whole = c.responses.create(model="tiny", input="Once upon a time", temperature=0, max_output_tokens=24)
    text = whole.output_text
    stop = text[5:8]
    cut = text[:text.index(stop)]
    for kw, terminal, answer in (({"extra_body": {"stop": [stop]}}, "response.completed", cut),
                                 ({}, "response.incomplete", text)):
        events = list(c.responses.create(model="tiny", input="Once upon a time", temperature=0,
                                         max_output_tokens=24, stream=True, **kw))
        types = [e.type for e in events]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert types == ["response.created", "response.in_progress", *TEXT_EVENTS[:2],
                         *["response.output_text.delta"] * len(deltas), *TEXT_EVENTS[2:], terminal]
        assert events[0].response.status == "in_progress" and events[0].response.output == []
        done = next(e for e in events if e.type == "response.output_text.done")
        final = events[-1].response
        assert "".join(deltas) == done.text == final.output_text == answer
        assert final.status == ("completed" if terminal == "response.completed" else "incomplete")
        assert final.usage.input_tokens == whole.usage.input_tokens
        if answer == text:
            assert final.usage.output_tokens == whole.usage.output_tokens == 24
        assert final.id != whole.id and final.id == events[0].response.id
    # the SDK's own stream helper accumulates the same answer from the events
    with c.responses.stream(model="tiny", input="Once upon a time", temperature=0, max_output_tokens=24,
                            extra_body={"stop": [stop]}) as helper:
        assert helper.get_final_response().output_text == cut
    # on the wire: an `event:` line naming each event, and no [DONE]
    with httpx.stream("POST", f"http://127.0.0.1:{server}/v1/responses", timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "input": "Hi", "max_output_tokens": 4, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    named = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert named == [d["type"] for d in data] and named[-1] == "response.incomplete"


def test_previous_response_id_continues_the_conversation(server):
    c = client(server)
    first = c.responses.create(model="tiny", instructions="Be kind.", input="Hello there", temperature=0,
                               max_output_tokens=8)
    second = c.responses.create(model="tiny", input="And then?", previous_response_id=first.id, temperature=0,
                                max_output_tokens=8)
    assert second.previous_response_id == first.id
    # the earlier exchange without its instructions (they do not carry over), then the new input
    history = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    want = chat(c, history, max_tokens=8)
    assert second.output_text == want.choices[0].message.content
    assert second.usage.input_tokens == want.usage.prompt_tokens > first.usage.input_tokens
    third = c.responses.create(model="tiny", input="Why?", previous_response_id=second.id, temperature=0,
                               max_output_tokens=8)
    want = chat(c, history + [{"role": "assistant", "content": second.output_text},
                              {"role": "user", "content": "Why?"}], max_tokens=8)
    assert (third.output_text, third.usage.input_tokens) == (want.choices[0].message.content,
                                                             want.usage.prompt_tokens)
    # stored responses can be read back and deleted; store=false keeps nothing
    assert c.responses.retrieve(first.id).output_text == first.output_text
    c.responses.delete(first.id)
    unstored = c.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    for gone in (first.id, unstored.id):
        with pytest.raises(openai.NotFoundError) as err:
            c.responses.create(model="tiny", input="Hi", previous_response_id=gone, max_output_tokens=2)
        assert err.value.body["param"] == "previous_response_id" and gone in err.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(gone)


def test_unknown_previous_response_id_is_a_404_naming_it(server):
    got = post(server, "/v1/responses", {"model": "tiny", "input": "Hi", "previous_response_id": "resp_nope"})
    assert got.status_code == 404
    error = got.json()["error"]
    assert error["param"] == "previous_response_id" and "'resp_nope'" in error["message"]


@pytest.mark.parametrize("extra, param", [
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice.type"),
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"max_output_token": 4}, "max_output_token"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": []}, None),
], ids=["reasoning", "background", "include", "built-in-tool", "built-in-tool-choice", "truncation", "image",
        "item-reference", "misspelt", "schema-less-format", "empty-input"])
def test_what_is_not_implemented_is_refused_by_name(server, extra, param):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model="tiny", input="Hi", extra_body=extra)
    body = err.value.body
    assert body["param"] == param
    assert (param or "input").split(".")[0] in body["message"]
    assert c.responses.create(model="tiny", input="Hi", max_output_tokens=2).status == "incomplete"


def test_a_named_function_tool_gives_a_function_call_item(server):
    c = client(server)
    ask = "What time is it in Tokyo?"
    want = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ask}], tools=[CHAT_CLOCK],
                                     tool_choice={"type": "function", "function": {"name": "get_time"}},
                                     max_tokens=40, temperature=0)
    got = c.responses.create(model="tiny", input=ask, tools=[CLOCK], max_output_tokens=40, temperature=0,
                             tool_choice={"type": "function", "name": "get_time"})
    [call] = got.output
    assert call.type == "function_call" and call.name == "get_time" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == json.loads(want.choices[0].message.tool_calls[0].function.arguments)
    assert got.status == "completed" and got.output_text == ""
    events = list(c.responses.create(model="tiny", input=ask, tools=[CLOCK], max_output_tokens=40, temperature=0,
                                     tool_choice={"type": "function", "name": "get_time"}, stream=True))
    types = [e.type for e in events]
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     *["response.function_call_arguments.delta"] * len(pieces),
                     "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    done = events[-3]
    assert "".join(pieces) == done.arguments == events[-1].response.output[0].arguments
    # the call and its output go back as input items, after the stored exchange
    follow = c.responses.create(model="tiny", previous_response_id=got.id, temperature=0, max_output_tokens=8,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "10:00"}])
    history = [{"role": "user", "content": ask},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": "get_time", "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "10:00"}]
    want = chat(c, history, tools=[CHAT_CLOCK], max_tokens=8)
    assert follow.output_text == want.choices[0].message.content
    assert follow.usage.input_tokens == want.usage.prompt_tokens


def test_bad_values_are_refused_in_the_fields_the_client_wrote(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError) as err:
        c.responses.create(model="tiny", input="Hi", tools=[CLOCK], tool_choice={"type": "function",
                                                                               "name": "get_weather"})
    assert "get_weather" in err.value.body["message"]
    for limit in (0, 600):           # below 1; beyond the context (--max-model-len 512)
        with pytest.raises(openai.BadRequestError) as err:
            c.responses.create(model="tiny", input="Hi", max_output_tokens=limit)
        assert "max_output_tokens" in err.value.body["message"] and "max_tokens" not in err.value.body["message"]


def test_the_responses_route_needs_the_key(server):
    assert post(server, "/v1/responses", {"model": "tiny", "input": "Hi"}, key="wrong").status_code == 401


def test_a_reasoning_parser_gives_a_reasoning_item_before_the_message(tiny_model_dir):
    """The tiny model writes a think block because a regex makes it (vLLM's structured_outputs field)."""
    steer = {"structured_outputs": {"regex": "<think>[a-z ]{4,16}</think>[A-Za-z ]{3,12}"}}
    port, ctx = start_server(tiny_model_dir, "--reasoning-parser", "qwen3", "--api-key", KEY)
    with ctx as proc:
        wait_ready(port, proc)
        c = client(port)
        msg = chat(c, [{"role": "user", "content": "Two and two?"}], max_tokens=48, extra_body=steer).choices[0].message
        reasoning, content = msg.model_extra["reasoning_content"], msg.content
        kw = {"model": "tiny", "input": "Two and two?", "temperature": 0, "max_output_tokens": 48, "extra_body": steer}
        got = c.responses.create(**kw)
        assert [item.type for item in got.output] == ["reasoning", "message"] and got.status == "completed"
        assert got.output[0].content[0].text == reasoning and got.output_text == content
        events = list(c.responses.create(**kw, stream=True))
        types = [e.type for e in events]
        r = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
        t = [e.delta for e in events if e.type == "response.output_text.delta"]
        assert types == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", *["response.reasoning_text.delta"] * len(r),
                         "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
                         *TEXT_EVENTS[:2], *["response.output_text.delta"] * len(t), *TEXT_EVENTS[2:],
                         "response.completed"]
        assert ("".join(r), "".join(t)) == (reasoning, content)
        assert [e.output_index for e in events if e.type == "response.output_item.done"] == [0, 1]
        # the follow-up's history holds the answer's content, not its reasoning (as a chat client sends it back)
        follow = c.responses.create(model="tiny", input="Sure?", previous_response_id=got.id, temperature=0,
                                    max_output_tokens=4)
        want = chat(c, [{"role": "user", "content": "Two and two?"}, {"role": "assistant", "content": content},
                        {"role": "user", "content": "Sure?"}], max_tokens=4)
        assert follow.usage.input_tokens == want.usage.prompt_tokens


def test_the_store_is_bounded_least_recently_used_out_first():
    from nanovllm_tp.serving.responses_store import ResponseStore
    store = ResponseStore(max_responses=2, max_chars=400)
    message = [{"role": "user", "content": "x" * 50}]
    for rid in ("a", "b"):
        assert store.put(rid, {"id": rid}, message)
    store.get("a")                                  # b is now the least recently used
    store.put("c", {"id": "c"}, message)
    assert store.get("a") is not None and store.get("b") is None and len(store) == 2
    store.put("d", {"id": "d"}, [{"role": "user", "content": "y" * 300}])     # over the characters: others go
    assert store.get("d") is not None and len(store) == 1 and store.chars <= 400
    assert not store.put("e", {"id": "e"}, [{"role": "user", "content": "z" * 500}]) and store.get("e") is None
    assert store.delete("d") and not store.delete("d") and store.chars == 0
