"""Per-request sampling knobs, with vLLM's names, defaults and ranges. Torch-free (the scheduler imports it), and
numpy-free until the sampler asks for a knob's arrays (the HTTP process imports it too, and numpy starts threads)."""
import math
from dataclasses import dataclass, field, fields
from enum import IntEnum

from nanovllm_tp.structured.params import StructuredOutputsParams
from nanovllm_tp.utils.checks import flag as _flag, integer as _integer, number as _number

# Below this a temperature is greedy: dividing logits by it would overflow float32 (as in vLLM).
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20          # the engine's default max_logprobs (vLLM's): the most top logprobs per position
MAX_BIAS = 100.0           # logit_bias values are clamped to [-MAX_BIAS, MAX_BIAS] (OpenAI's range)
_INT64_MAX = 2**63 - 1     # the per-row arrays' integers
MAX_BAD_WORDS = 128        # token sequences bad_words may come to, each spelling counted (vLLM's default)


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
    logit_bias: dict[int, float] | None = None   # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None   # only these tokens may be sampled
    bad_words: list[str] | None = None    # words the output never completes (tokenized when the request is admitted)
    structured_outputs: StructuredOutputsParams | None = None   # JSON schema, regex, choice or grammar (a dict works)
    # forms derived by validate(), by the sampler on first use (arrays), by tokenize_bad_words()
    _stops: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _bias: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _allowed: object = field(default=None, init=False, repr=False, compare=False)
    _bad_words_token_ids: tuple | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.validate()

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return self._stops

    @property
    def bias_arrays(self):
        """logit_bias as numpy arrays (token ids int64, biases float32 clamped to [-MAX_BIAS, MAX_BIAS]), made on
        first use after validate(); None without a logit_bias."""
        if self._bias is None and self.logit_bias is not None:
            import numpy as np
            bias = self.logit_bias
            self._bias = (np.fromiter(bias, np.int64, len(bias)), np.fromiter(
                (float(min(max(b, -MAX_BIAS), MAX_BIAS)) for b in bias.values()), np.float32, len(bias)))
        return self._bias

    @property
    def allowed_array(self):
        """allowed_token_ids as a numpy array of sorted distinct int64 ids, made on first use after validate();
        None without allowed_token_ids."""
        if self._allowed is None and self.allowed_token_ids is not None:
            import numpy as np
            self._allowed = np.unique(np.asarray(self.allowed_token_ids, np.int64))
        return self._allowed

    @property
    def bad_words_token_ids(self) -> tuple[tuple[int, ...], ...] | None:
        """The token sequences of bad_words (tokenize_bad_words); None until the request is admitted."""
        return self._bad_words_token_ids

    @classmethod
    def unvalidated(cls, **kw) -> "SamplingParams":
        """Params from fields checked elsewhere, before validate() runs on them (the engine's side of the server:
        LLM.add_request validates what arrives). Unknown names raise TypeError, as the constructor does."""
        unknown = set(kw) - {f.name for f in fields(cls) if f.init}
        if unknown:
            raise TypeError(f"unknown sampling parameters: {sorted(unknown)}")
        self = cls.__new__(cls)
        for f in fields(cls):
            setattr(self, f.name, kw.get(f.name, f.default))
        return self

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
        _integer("max_tokens", self.max_tokens, lo=1, hi=_INT64_MAX, optional=True)
        _integer("min_tokens", self.min_tokens, lo=0, hi=_INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        _integer("logprobs", self.logprobs, lo=0, hi=_INT64_MAX, optional=True)      # the engine's max_logprobs
        _integer("prompt_logprobs", self.prompt_logprobs, lo=0, hi=_INT64_MAX, optional=True)   # bounds them
        _flag("skip_special_tokens", self.skip_special_tokens)
        _integer("stream_interval", self.stream_interval, lo=1, optional=True)
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except (ValueError, TypeError):
                raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}") from None
        _check_logit_bias(self.logit_bias)
        _check_allowed(self.allowed_token_ids)
        self._bias = self._allowed = None          # made again from the fields as they are now
        if self.bad_words is not None:
            if not isinstance(self.bad_words, (list, tuple)) or not all(isinstance(w, str) for w in self.bad_words):
                raise TypeError("bad_words must be a list of strings")
            if any(not w.strip() for w in self.bad_words):
                raise ValueError("bad_words cannot contain an empty or blank string")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
            self.structured_outputs.validate()

    def check_vocab(self, vocab_size: int) -> None:
        """Checks that need the model: token ids inside the vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("allowed_token_ids", self.allowed_token_ids),
                          ("logit_bias", self.logit_bias)):
            bad = [t for t in (ids or ()) if t >= vocab_size]
            if bad:
                raise ValueError(f"{name} {bad} are outside the vocabulary [0, {vocab_size})")

    def tokenize_bad_words(self, tokenizer, vocab_size: int) -> None:
        """bad_words as token sequences, as vLLM spells them: each word (leading spaces dropped) on its own, and
        with one leading space when that starts with another token and has as many; no special tokens added."""
        words = dict.fromkeys(self.bad_words or ())
        seqs = []
        for word in words:
            plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
            if not plain:
                raise ValueError(f"bad_words: {word!r} comes to no token")
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            seqs.append(plain)
            if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
                seqs.append(spaced)
        if len(seqs) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words come to {len(seqs)} token sequences; at most {MAX_BAD_WORDS} are allowed")
        bad = sorted({t for ids in seqs for t in ids if t >= vocab_size})
        if bad:
            raise ValueError(f"bad_words tokenize to ids {bad} outside the model's vocabulary [0, {vocab_size})")
        self._bad_words_token_ids = tuple(dict.fromkeys(seqs))


def _check_logit_bias(bias) -> None:
    if bias is None:
        return
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
    for t, b in bias.items():
        _integer("each token id of logit_bias", t, lo=0)
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise TypeError(f"logit_bias[{t}] must be a number, got {type(b).__name__}")
        if isinstance(b, float) and not math.isfinite(b):
            raise ValueError(f"logit_bias[{t}] must be a finite number, got {b}")


def _check_allowed(ids) -> None:
    if ids is None:
        return
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"allowed_token_ids must be a list of ints, got {type(ids).__name__}")
    if not ids:
        raise ValueError("allowed_token_ids cannot be empty (None allows every token)")
    for t in ids:
        _integer("each of allowed_token_ids", t, lo=0)
