"""vLLM's serving flags, the rules each stands on, without a model or a server: --chat-template's file or in-place
template (refused in one line when it cannot be read or compiled), --tool-call-parser's formats, the request
defaults of --generation-config filling what a body leaves unset (a value the body gives wins), and the
generation_config.json fields that make those defaults."""
import json
from types import SimpleNamespace

import pytest

from nanovllm_tp.config.generation_defaults import check_generation_config, sampling_defaults
from nanovllm_tp.entrypoints.chat_template import load_chat_template
from nanovllm_tp.serving.protocol import ChatCompletionRequest, CompletionRequest
from nanovllm_tp.serving.tool_calls import ToolMode, check_tool_parser, parse_auto

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
HERMES = 'ok <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
LLAMA = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE
    assert load_chat_template(None) is None
    # in place, as one shell argument: \n read as a newline (vLLM reads escapes the same way)
    assert load_chat_template(TEMPLATE.replace("\n", "\\n")) == TEMPLATE
    assert load_chat_template("{{ 'café ✓' }}") == "{{ 'café ✓' }}"


@pytest.mark.parametrize("value,words", [
    ("/nowhere/template.jinja", ["--chat-template '/nowhere/template.jinja' reads as a file path",
                                 "No such file or directory"]),
    ("{% for m in messages %}{{ m }}", ["--chat-template", "Jinja syntax error on line 1", "endfor"]),
    ("{{ messages | no_such_filter }}", ["--chat-template", "no_such_filter"]),
    ("  {} ", None),
])
def test_a_chat_template_that_cannot_be_read_or_compiled_is_one_line(value, words, tmp_path):
    if words is None:                       # a file of nothing but blanks
        (tmp_path / "blank.jinja").write_text("  \n")
        value, words = str(tmp_path / "blank.jinja"), ["is empty"]
    with pytest.raises(ValueError) as info:
        load_chat_template(value)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_the_tool_call_parser_picks_the_format_auto_reads():
    names = {"get_weather"}
    assert parse_auto(HERMES, names)[1] == parse_auto(HERMES, names, "hermes")[1] == [("get_weather",
                                                                                       '{"city": "Oslo"}')]
    assert parse_auto(LLAMA, names)[1] == parse_auto(LLAMA, names, "llama3_json")[1] == [("get_weather",
                                                                                         '{"city": "Oslo"}')]
    assert parse_auto(HERMES, names, "llama3_json") == (HERMES, [])        # the other format is content
    assert parse_auto(LLAMA, names, "hermes") == (LLAMA, [])
    for parser, text, calls in (("llama3_json", HERMES, 0), ("hermes", HERMES, 1), ("llama4_json", LLAMA, 1)):
        streamer = ToolMode([WEATHER], "auto", parser=parser).streamer()
        content, deltas = "", []
        for i in range(0, len(text), 5):
            piece, tool_deltas = streamer.feed(text[i:i + 5], i + 5 >= len(text))
            content, deltas = content + piece, deltas + tool_deltas
        assert len(deltas) == calls and (content == text if not calls else "tool_call" not in content), parser


def test_tool_parser_names_and_auto_tool_choice():
    check_tool_parser(None, False)
    check_tool_parser("hermes", True)
    with pytest.raises(ValueError, match="--tool-call-parser 'mistral' is not implemented: this server reads "
                                         "hermes .*, llama3_json"):
        check_tool_parser("mistral", True)
    with pytest.raises(ValueError, match="--no-enable-auto-tool-choice turns off"):
        check_tool_parser("hermes", False)
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "tools": [{"type": "function", "function": WEATHER}]})
    assert body.tool_mode(True, "hermes").parser == "hermes"
    with pytest.raises(ValueError, match="--enable-auto-tool-choice"):
        body.tool_mode(False)                       # tools without tool_choice: "auto"
    named = body.model_copy(update={"tool_choice": "required"})
    assert named.tool_mode(False).choice == "required"


def test_request_defaults_fill_only_what_a_body_leaves_unset():
    defaults = {"temperature": 0.0, "top_k": 3, "max_tokens": 7, "repetition_penalty": 1.2}
    completion = CompletionRequest.model_validate({"prompt": "x"})
    assert (completion.sampling_params().temperature, completion.sampling_params().max_tokens) == (1.0, 16)
    params = completion.sampling_params(defaults)
    assert (params.temperature, params.top_k, params.max_tokens, params.repetition_penalty) == (0.0, 3, 7, 1.2)
    given = CompletionRequest.model_validate({"prompt": "x", "temperature": 0.5, "max_tokens": 2, "top_k": None})
    params = given.sampling_params(defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 3, 2)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert chat.sampling_params().max_tokens is None and chat.sampling_params(None, defaults).max_tokens == 7
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": 4, "temperature": 0.9})
    assert (chat.sampling_params(None, defaults).max_tokens, chat.sampling_params(None, defaults).temperature) \
        == (4, 0.9)


def test_generation_config_fields_become_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_new_tokens": 64,
         "repetition_penalty": 1.05, "eos_token_id": 2, "max_length": 99, "num_beams": 1}))
    config = SimpleNamespace(model=str(tmp_path), generation_config="auto")
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "max_tokens": 64,
            "repetition_penalty": 1.05}
    check_generation_config(config)
    assert sampling_defaults(config) == want
    assert sampling_defaults(SimpleNamespace(model=str(tmp_path), generation_config="vllm")) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text('{"temperature": 0.1}')
    config = SimpleNamespace(model=str(tmp_path), generation_config=str(other))
    check_generation_config(config)
    assert sampling_defaults(config) == {"temperature": 0.1}
    for value, words in ((str(tmp_path / "missing"), "is not 'auto', 'vllm' or a directory"),
                         (str(tmp_path / "empty"), "the directory holds no generation_config.json")):
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(ValueError, match=words):
            check_generation_config(SimpleNamespace(model=str(tmp_path), generation_config=value))
    (other / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ValueError, match=r"other/generation_config.json: top_p must be > 0.0, got 0 "
                                         r"\(--generation-config vllm does not read the file\)"):
        check_generation_config(SimpleNamespace(model=str(tmp_path), generation_config=str(other)))
