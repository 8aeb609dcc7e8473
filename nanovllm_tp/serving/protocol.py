"""OpenAI request bodies (pydantic) and their mapping onto SamplingParams, with vLLM's extra fields: the one place
to import them from, and the table of the fields this server refuses.

A body holds only what is declared, in the declared JSON types: strict (a bool is not a number, a float is not an
int), every integer within 64 bits and every string valid Unicode, whatever field it is in (body.py). A field this
server does not implement is refused by name (REFUSED_FIELDS says why), and so is one it does not know: nothing a
client sends is ignored. Ranges are the engine's own validation (SamplingParams), so the HTTP API refuses exactly
what the Python API refuses, with the same message. The bodies: completion_request.py (the sampling fields every
generating body shares, /v1/completions), chat_request.py (/v1/chat/completions: messages, tools).
"""
from nanovllm_tp.serving.body import INT64, UNION_MEMBERS, Int, Prompt, Stop, TokenKey
from nanovllm_tp.serving.chat_request import (ChatCompletionRequest, ChatMessage, Content, FunctionDef, NamedFunction,
                                              NamedToolChoice, TextPart, ToolDef)
from nanovllm_tp.serving.completion_request import (CompletionRequest, ResponseFormat, StreamOptions,
                                                    structured_outputs_of)

__all__ = ["REFUSED_FIELDS", "DECLARED_FIELDS", "INT64", "UNION_MEMBERS", "Int", "Prompt", "Stop", "TokenKey",
           "ChatCompletionRequest", "ChatMessage", "Content", "FunctionDef", "NamedFunction", "NamedToolChoice",
           "TextPart", "ToolDef", "CompletionRequest", "ResponseFormat", "StreamOptions", "structured_outputs_of"]

_GUIDED = "vLLM's older guided_* fields are not accepted: use structured_outputs (or response_format)"
_FUNCTIONS = "OpenAI's deprecated function calling is not implemented: use tools and tool_choice"
_BEAM = "beam search is not implemented"
_REASONING = "reasoning options are not implemented"
# Fields of the OpenAI and vLLM APIs that this server does not implement, each refused with a 400 that names it and
# says why (a field that is neither declared nor here is refused as unknown). The change that implements one
# deletes its entry and declares the field.
REFUSED_FIELDS: dict[str, str] = {
    "guided_json": _GUIDED, "guided_regex": _GUIDED, "guided_choice": _GUIDED, "guided_grammar": _GUIDED,
    "guided_decoding_backend": _GUIDED, "guided_whitespace_pattern": _GUIDED,
    "functions": _FUNCTIONS, "function_call": _FUNCTIONS,
    "best_of": "best_of is not implemented (n completions come back as sampled, none ranked or dropped)",
    "use_beam_search": _BEAM, "length_penalty": _BEAM, "early_stopping": _BEAM,
    "suffix": "suffix (text after the completion) is not implemented",
    "prompt_logprobs": "prompt logprobs come back only through /v1/completions' echo with logprobs",
    "audio": "only text output is implemented", "modalities": "only text output is implemented",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": _REASONING, "include_reasoning": _REASONING, "verbosity": "verbosity is not implemented",
    "web_search_options": "web search is not implemented",
    "truncate_prompt_tokens": "prompt truncation is not implemented: the prompt must fit max_model_len",
    "chat_template": "a request's own chat template is not accepted: the server's is used (the model's, or "
                     "--chat-template's)",
    "continue_final_message": "continue_final_message is not implemented",
    "documents": "documents for the chat template are not implemented",
    "mm_processor_kwargs": "multimodal inputs are not implemented",
    "image_url": "image inputs are not implemented (text parts only)",
    "input_audio": "audio inputs are not implemented (text parts only)",
    "file": "file inputs are not implemented (text parts only)",
    "logits_processors": "custom logits processors are not accepted",
    "return_tokens_as_token_ids": "token ids in place of token text are not implemented",
    "return_token_ids": "token ids in responses are not implemented",
    "spaces_between_special_tokens": "spaces_between_special_tokens is not implemented",
    "add_special_tokens": "add_special_tokens is not implemented (prompts get the tokenizer's default)",
    "cache_salt": "cache_salt is not implemented", "kv_transfer_params": "KV transfer is not implemented",
    "vllm_xargs": "vllm_xargs is not accepted",
}


# every field name a body may hold somewhere (the wording of refusals offers the closest one)
DECLARED_FIELDS = sorted({name for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, TextPart,
                                         StreamOptions, ResponseFormat, FunctionDef, ToolDef, NamedToolChoice)
                           for name in m.model_fields})
if set(REFUSED_FIELDS) & set(DECLARED_FIELDS):
    raise ImportError(f"fields both declared and refused: {set(REFUSED_FIELDS) & set(DECLARED_FIELDS)}")
