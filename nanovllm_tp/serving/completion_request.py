"""The fields every generating body shares (`SamplingFields`) and their mapping onto SamplingParams, and
/v1/completions' body. A body field named as a SamplingParams field is that field (absent or null: its default);
the endpoints set the rest (max_tokens, logprobs, prompt_logprobs, output_kind) from OpenAI's names. Ranges are the
engine's own validation (SamplingParams), so the HTTP API refuses exactly what the Python API refuses."""
from dataclasses import fields
from typing import Literal

from nanovllm_tp.entrypoints.prompts import prompt_list
from nanovllm_tp.sampling_params import RequestOutputKind, SamplingParams
from nanovllm_tp.serving.body import Body, Int, Prompt, Stop, TextBody, TokenKey
from nanovllm_tp.serving.tool_calls import ToolMode

_SET_BY_ENDPOINT = ("max_tokens", "logprobs", "prompt_logprobs", "output_kind")
_FROM_BODY = tuple(f.name for f in fields(SamplingParams) if f.init and f.name not in _SET_BY_ENDPOINT)


class StreamOptions(Body):
    include_usage: bool = False


class ResponseFormat(Body):
    """OpenAI's response_format: text, json_object, or json_schema {"name", "schema", "strict", ...}."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, object] | None = None


def structured_outputs_of(response_format: ResponseFormat | None, structured_outputs: dict | None,
                          tools: ToolMode | None = None) -> dict | None:
    """The request's structured_outputs (as StructuredOutputsParams' dict) from response_format, vLLM's
    structured_outputs body field, or the schema tool_choice "required" / a named function enforces; at most one
    of them."""
    given = {}
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            given["response_format"] = {"json_object": True}
        else:
            spec = response_format.json_schema or {}
            if not isinstance(spec.get("schema"), dict):
                raise ValueError("response_format json_schema needs a 'schema' object")
            given["response_format"] = {"json": spec["schema"]}
    if structured_outputs is not None:
        given["structured_outputs"] = structured_outputs
    schema = tools.schema() if tools is not None else None
    if schema is not None:
        given[f"tool_choice={tools.choice if tools.choice != 'named' else tools.name!r}"] = {"json": schema}
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both constrain the output; give one")
    return next(iter(given.values()), None)


class SamplingFields(TextBody):
    """Fields shared by completions and chat completions."""
    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Stop | None = None
    seed: Int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[TokenKey, float] | None = None     # token ids as JSON object keys (strings), as OpenAI sends
    # accepted, and without effect on the output: bookkeeping for OpenAI's own service
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None        # this server's prefix cache needs no hint
    safety_identifier: str | None = None
    # vLLM's extra fields
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: Int = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    stream_interval: Int | None = None
    allowed_token_ids: list[Int] | None = None
    priority: Int = 0          # lower first, on a server started with --scheduling-policy priority
    bad_words: list[str] | None = None
    structured_outputs: dict[str, object] | None = None     # StructuredOutputsParams' fields: json, regex, ...
    response_format: ResponseFormat | None = None

    def _params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None,
                tools: ToolMode | None = None, defaults: dict | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        kw = {name: value for name in _FROM_BODY if (value := getattr(self, name)) is not None}
        for name, value in (defaults or {}).items():       # the engine's request defaults (--generation-config)
            if name in _FROM_BODY:
                kw.setdefault(name, value)
        kw["structured_outputs"] = structured_outputs_of(self.response_format, self.structured_outputs, tools)
        return SamplingParams(**kw, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


_MISSING = set(_FROM_BODY) - set(SamplingFields.model_fields)
if _MISSING:      # every knob is the server's too
    raise ImportError(f"SamplingParams fields the request bodies lack: {_MISSING}")


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Int | None = 16
    logprobs: Int | None = None          # top-N per token (OpenAI allows up to 5; the engine up to 20)
    echo: bool = False

    def prompts(self) -> list:
        """One entry per prompt: a string or a list of token ids."""
        return prompt_list(self.prompt, "prompt")

    def sampling_params(self, defaults: dict | None = None) -> SamplingParams:
        """`defaults`: the engine's request defaults (--generation-config) for the fields the body leaves unset;
        max_tokens left out is the default's, else 16 (OpenAI's)."""
        max_tokens = self.max_tokens
        if "max_tokens" not in self.model_fields_set:
            max_tokens = (defaults or {}).get("max_tokens", max_tokens)
        return self._params(max_tokens, self.logprobs,
                            (self.logprobs or 0) if self.echo and self.logprobs is not None else None,
                            defaults=defaults)
