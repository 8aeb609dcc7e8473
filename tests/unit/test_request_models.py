"""The server's request models and the rules beside them, without a server: how a refused body is worded, the
chat template's own arguments, a top_k past 32 bits."""
import numpy as np
import pytest
from pydantic import ValidationError

from nanovllm_tp.entrypoints.prompts import render_chat, template_arguments
from nanovllm_tp.sampling_params import SamplingParams
from nanovllm_tp.scheduler.rows import ROW_DTYPE, row_record
from nanovllm_tp.serving.protocol import REFUSED_FIELDS, ChatCompletionRequest, CompletionRequest
from nanovllm_tp.serving.responses import validation_message

CHAT = [{"role": "user", "content": "hi"}]


def message(model, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    return validation_message(info.value.errors())


@pytest.mark.parametrize("model,body,want", [
    (CompletionRequest, {"prompt": "x", "best_of": 2, "n": "two"}, (
        "best_of: not supported: " + REFUSED_FIELDS["best_of"], "best_of")),
    (CompletionRequest, {"prompt": "x", "tools": []}, (
        "tools: not a field here (it is one of another endpoint or object)", "tools")),
    (CompletionRequest, {"prompt": "x", "temprature": 1}, ("temprature: unknown field; did you mean 'temperature'?",
                                                          "temprature")),
    (ChatCompletionRequest, {"messages": CHAT, "echo": True}, (
        "echo: not a field here (it is one of another endpoint or object)", "echo")),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
     ("messages.0.content.0.text: Input should be a valid string", "messages.0.content.0.text")),
    (CompletionRequest, {"prompt": [[1, 2], [3, "4"]]}, ("prompt.1.1: Input should be a valid integer", "prompt.1.1")),
    (CompletionRequest, {"prompt": {"text": "x"}}, (
        "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt")),
    (CompletionRequest, {"prompt": "x", "seed": 10**40}, (
        "seed: must be an integer in [-2**63, 2**63)", "seed")),
    (CompletionRequest, {"prompt": "x", "stop": {"\ud800": 1}}, (
        "stop.\\ud800: not valid Unicode text (a lone surrogate at index 0); every string must encode as UTF-8",
        "stop.\\ud800")),
])
def test_a_refused_body_names_its_field(model, body, want):
    """A field that is not declared wins over other errors; union members never show in the path."""
    assert message(model, body) == want


def test_the_body_as_a_whole():
    assert message(CompletionRequest, [1]) == ("the body must be a JSON object", None)


def test_chat_template_kwargs_cannot_set_apply_chat_template_s_own_arguments(tiny_model_dir):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert {"tokenize", "add_generation_prompt", "chat_template", "return_dict", "conversation"} <= \
        template_arguments(tok)
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set 'return_dict', 'tokenize'"):
        render_chat(tok, CHAT, chat_template_kwargs={"tokenize": True, "return_dict": False, "x": 1})
    assert render_chat(tok, CHAT, chat_template_kwargs={"x": 1}) == render_chat(tok, CHAT)


def test_a_top_k_beyond_32_bits_is_off_in_the_row():
    """It used to overflow the row's int32 and stop the engine."""
    rows = np.array([row_record(SamplingParams(top_k=2**62), seed=0)], ROW_DTYPE)
    assert rows["top_k"][0] == 2**31 - 1
