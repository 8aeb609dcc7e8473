"""Per-request sampling knobs, with vLLM's names, defaults and ranges. Torch-free: the scheduler imports it."""
from dataclasses import dataclass, field
from enum import IntEnum

from nanovllm_tp.checks import flag as _flag, integer as _integer, number as _number

# Below this a temperature is greedy: dividing logits by it would overflow float32 (as in vLLM).
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20          # the most top logprobs one position may ask for (vLLM's default max_logprobs)


class RequestOutputKind(IntEnum):
    """What step() reports for a request that progressed (vLLM's names)."""
    CUMULATIVE = 0     # everything generated so far
    DELTA = 1          # only what is new since the last output
    FINAL_ONLY = 2     # nothing until the request finishes


@dataclass(slots=True)
class SamplingParams:
    n: int = 1                            # completions per prompt (the prompt is prefilled once)
    temperature: float = 1.0              # 0 (or below 1e-5) = greedy
    top_p: float = 1.0                    # (0, 1]; 1 = off
    top_k: int = 0                        # 0 or -1 = off
    min_p: float = 0.0                    # [0, 1]; drop tokens below min_p * the top token's probability
    seed: int | None = None               # None: drawn from the engine's seed and the request id
    presence_penalty: float = 0.0         # [-2, 2], over output tokens (OpenAI's formula)
    frequency_penalty: float = 0.0        # [-2, 2], over output tokens
    repetition_penalty: float = 1.0       # > 0, over prompt and output tokens (1 = off)
    stop: str | list[str] | None = None   # stop strings, matched on the text as it grows
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16           # None: up to max_model_len
    min_tokens: int = 0                   # EOS and stop_token_ids are suppressed until this many tokens
    logprobs: int | None = None           # top-N logprobs of each sampled position (plus the sampled token)
    prompt_logprobs: int | None = None    # top-N logprobs of each prompt position
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stream_interval: int | None = None    # outputs every N new tokens (first and last at once); None: the engine's
    _stops: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self):
        self.validate()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stops

    def validate(self) -> None:
        """Raise a ValueError/TypeError a user can act on; generate() calls it again in case fields were edited."""
        _integer("n", self.n, lo=1)
        _number("temperature", self.temperature, lo=0.0)
        _number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _integer("top_k", self.top_k, lo=-1)
        _number("min_p", self.min_p, lo=0.0, hi=1.0)
        _integer("seed", self.seed, lo=0, hi=2**63 - 1, optional=True)
        _number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        _number("repetition_penalty", self.repetition_penalty, lo=0.0, lo_open=True)
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)):
            stop = tuple(stop)
            bad = next((s for s in stop if not isinstance(s, str)), None)
            if bad is not None:
                raise TypeError(f"stop must be a string or a list of strings, got an item of type {type(bad).__name__}")
        else:
            raise TypeError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        if any(s == "" for s in stop):
            raise ValueError("stop cannot contain an empty string")
        self._stops = stop
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise TypeError(f"stop_token_ids must be a list of ints, got {type(self.stop_token_ids).__name__}")
            for t in self.stop_token_ids:
                _integer("each of stop_token_ids", t, lo=0)
        _flag("include_stop_str_in_output", self.include_stop_str_in_output)
        _flag("ignore_eos", self.ignore_eos)
        _integer("max_tokens", self.max_tokens, lo=1, optional=True)
        _integer("min_tokens", self.min_tokens, lo=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        _integer("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS, optional=True)
        _integer("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS, optional=True)
        _flag("skip_special_tokens", self.skip_special_tokens)
        _integer("stream_interval", self.stream_interval, lo=1, optional=True)
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except (ValueError, TypeError):
                raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}") from None

    def check_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids inside the vocabulary."""
        bad = [t for t in (self.stop_token_ids or ()) if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")
