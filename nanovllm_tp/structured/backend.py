"""The grammar backend on rank 0: llguidance (a Rust library; numpy masks, no torch).

Why llguidance: it builds a JSON schema, regex, Lark or GBNF grammar in about a millisecond (its lexer and
Earley parser work lazily, one token mask at a time, instead of precomputing a table per grammar), computes a
mask in tens of microseconds on a 50k vocabulary, works at the byte level (tokens that straddle a grammar's
lexemes are handled, with any tokenizer), rolls back, and bounds every step's work by fuel limits; its Python
side needs numpy only, so nothing here imports torch.

One `GrammarBackend` per engine: it compiles each request's constraint in a worker thread, caches the result by
(kind, spec, options), and gives each sequence its own matcher (`Grammar`, a copy of the compiled one). A
compile that misses the engine's time limit fails that request with a ValueError naming the limit, and so does
every later request with the same constraint; the engine and the other requests never wait for it.
"""
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from nanovllm_tp.structured.params import StructuredOutputsParams

log = logging.getLogger("nanovllm_tp")
WHITESPACE = r"(\x0D?\x0A)?[\x20\x09]{0,16}"   # JSON whitespace between tokens: one line break, indentation
CACHE_SIZE = 256                           # compiled constraints kept (least recently used dropped first)
COMPILE_THREADS = 2


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as llguidance's grammar (a JSON string)."""
    import llguidance
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else json.loads(params.spec)
        if params.disable_additional_properties:
            schema = _closed(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:
            options["whitespace_pattern"] = params.whitespace_pattern or WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    return llguidance.grammar_from("grammar", params.grammar)     # GBNF (::= rules) or Lark


def _closed(schema):
    """The schema with additionalProperties false on every object that does not say otherwise."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _closed(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class Grammar:
    """One sequence's matcher. It follows the sequence's output tokens (advanced on the tokens the sequence
    accepted, rolled back if they shrink), and gives the mask of the next token: only what keeps the output a
    prefix of the language, and EOS only where the language may end. After EOS it constrains nothing more."""
    __slots__ = ("matcher", "backend", "consumed", "ended", "error")

    def __init__(self, matcher, backend: "GrammarBackend"):
        self.matcher, self.backend = matcher, backend
        self.consumed = 0          # output tokens the matcher took
        self.ended = False         # it took an EOS
        self.error: str | None = None

    @property
    def constrains(self) -> bool:
        return not self.ended and self.error is None

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> str | None:
        """Bring the matcher to the sequence's output; returns an error when a token is outside the language
        (another knob left the mask nothing to choose, or the grammar hit one of its limits)."""
        out = len(token_ids) - num_prompt_tokens
        if out < self.consumed:
            self.matcher.rollback(self.consumed - out)
            self.consumed, self.ended = out, False
        if self.error is not None or self.ended:
            return self.error
        eos = self.backend.eos
        for t in token_ids[num_prompt_tokens + self.consumed:]:
            if not self.matcher.consume_token(t):
                self.error = self.matcher.get_error() or f"token {t} does not continue the structured output"
                return self.error
            self.consumed += 1
            if t in eos:
                self.ended = True
                break
        return None


class CompiledGrammar:
    __slots__ = ("matcher", "backend")

    def __init__(self, matcher, backend: "GrammarBackend"):
        self.matcher, self.backend = matcher, backend

    def new(self) -> Grammar:
        return Grammar(self.matcher.deep_copy(), self.backend)


class Pending:
    """A compile in flight: ready when done or past its deadline (then compile() gives the request its error)."""
    __slots__ = ("future", "deadline")

    def __init__(self, future: Future, deadline: float):
        self.future, self.deadline = future, deadline

    def ready(self) -> bool:
        return self.future.done() or time.monotonic() >= self.deadline


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, timeout: float):
        self.hf_tokenizer, self.vocab_size, self.timeout = tokenizer, vocab_size, timeout
        eos = tuple(eos_token_ids) or ((tokenizer.eos_token_id,) if tokenizer is not None and
                                       tokenizer.eos_token_id is not None else ())
        self.eos = frozenset(eos)
        self.words = (vocab_size + 31) // 32        # int32 words of one mask (the tokenizer's size if larger)
        self._tokenizer = None
        self._lock, self._tokenizer_lock = threading.Lock(), threading.Lock()
        self._pool: ThreadPoolExecutor | None = None          # compiles
        self._mask_thread: ThreadPoolExecutor | None = None   # a step's masks, during the forward
        self._cache: OrderedDict[tuple, Pending] = OrderedDict()
        self.mask_steps, self.masks_filled, self.mask_seconds = 0, 0, 0.0     # fill_masks' lifetime cost

    def submit(self, params: StructuredOutputsParams) -> Pending:
        """Start (or find) the compile of a validated constraint."""
        if self.hf_tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this model directory has none")
        key = params.key
        with self._lock:
            pending = self._cache.get(key)
            if pending is not None:
                self._cache.move_to_end(key)
                return pending
            if self._pool is None:
                self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="nanovllm-grammar")
            pending = Pending(self._pool.submit(self._compile, params), time.monotonic() + self.timeout)
            self._cache[key] = pending
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return pending

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, waiting at most until its deadline; ValueError if it is invalid, uses what the
        backend does not implement, or missed the time limit."""
        pending = self.submit(params)
        try:
            return pending.future.result(timeout=max(pending.deadline - time.monotonic(), 0.0))
        except TimeoutError:
            failed = Future()
            failed.set_exception(ValueError(
                f"structured_outputs.{params.kind} did not compile within the time limit of {self.timeout:g} s "
                "(the engine's grammar_compile_timeout)"))
            with self._lock:
                self._cache[params.key] = Pending(failed, 0.0)
            return failed.result()

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance
        text = grammar_text(params)
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0,
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {matcher.get_error()}")
        return CompiledGrammar(matcher, self)

    def tokenizer(self):
        """llguidance's view of the model's tokenizer (built once, on the first compile: ~0.5 s for 50k tokens)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                import llguidance.hf
                size = max(self.vocab_size, len(self.hf_tokenizer))     # ids past the logits are never sampled
                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=size,
                                                                   eos_token=sorted(self.eos) or None)
                except Exception as exc:          # a slow (non-Rust) tokenizer, or one llguidance cannot read
                    raise ValueError(f"structured outputs cannot use this model's tokenizer: {exc}") from None
                self.words = (size + 31) // 32
            return self._tokenizer

    def fill_masks(self, grammars: list[tuple[Grammar, object]]) -> np.ndarray:
        """The next-token bitmasks ([len, words] int32, bit t of a row: token t allowed) of (grammar, sequence)
        pairs, each grammar brought up to its sequence first. One after another: tens of microseconds each,
        where llguidance's thread pool lost more than it won next to the model's threads on a busy 2-core machine
        (BENCHMARKS.md)."""
        import llguidance.numpy
        start = time.perf_counter()
        masks = np.zeros((len(grammars), self.words), np.int32)
        for g, seq in grammars:
            g.advance(seq.token_ids, seq.num_prompt_tokens)
        for i, (g, _) in enumerate(grammars):
            llguidance.numpy.fill_next_token_bitmask(g.matcher, masks, i)
        self.mask_steps, self.masks_filled = self.mask_steps + 1, self.masks_filled + len(grammars)
        self.mask_seconds += time.perf_counter() - start
        return masks

    def fill_masks_soon(self, grammars: list[tuple[Grammar, object]]) -> Future:
        """fill_masks on a thread of its own (never behind a compile): llguidance leaves the interpreter lock
        while it computes, so the masks are made while the model runs."""
        with self._lock:
            if self._mask_thread is None:
                self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="nanovllm-masks")
            return self._mask_thread.submit(self.fill_masks, grammars)

    def close(self) -> None:
        for pool in (self._pool, self._mask_thread):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
        self._pool = self._mask_thread = None
