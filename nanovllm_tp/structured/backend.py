"""The grammar backend on rank 0: llguidance (a Rust library; numpy masks, no torch).

Why llguidance: it builds a JSON schema, regex, Lark or GBNF grammar in about a millisecond (its lexer and
Earley parser work lazily, one token mask at a time, instead of precomputing a table per grammar), computes a
mask in tens of microseconds on a 50k vocabulary, works at the byte level (tokens that straddle a grammar's
lexemes are handled, with any tokenizer), rolls back, and bounds every step's work by fuel limits; its Python
side needs numpy only, so nothing here imports torch.

One `GrammarBackend` per engine: it compiles each request's constraint on one of two threads (lanes: small
constraints apart from large ones, smallest first in each), caches the result by (kind, spec, options), and
gives each sequence its own matcher (`Grammar`, a copy of the compiled one). A compile tries the output's start
(the first mask, the bytes every output must begin with), so a constraint that accepts nothing or runs into the
parser's limits at once is refused before any token. Each request waits at most the engine's time limit from
its own arrival; past it, that request fails with a ValueError naming the limit, and nothing else: the timeout
is no verdict on the constraint, a queued compile nobody waits for is dropped, and a running one stops at its
next stage (llguidance cannot stop a build midway).
"""
import heapq
import itertools
import json
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor

import numpy as np

from nanovllm_tp.structured.number_digits import DigitLimits, NumberDigits, TokenDigits, limits_of
from nanovllm_tp.structured.params import StructuredOutputsParams
from nanovllm_tp.structured.schema import check_terminates, rewrite_subschemas

log = logging.getLogger("nanovllm_tp")
WHITESPACE = r"(\x0D?\x0A)?[\x20\x09]{0,16}"   # JSON whitespace between tokens: one line break, indentation
CACHE_SIZE = 256                           # compiled constraints kept (least recently used dropped first)
START = "at the start of the output"
SMALL_SPEC_CHARS = 16 << 10               # constraints up to this long compile in a lane of their own


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as llguidance's grammar (a JSON string)."""
    import llguidance
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else json.loads(params.spec)
        try:
            check_terminates(schema)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json: {exc}") from None
        if params.disable_additional_properties is not False and kind == "json":
            schema = _closed(schema, every=bool(params.disable_additional_properties))
        schema = _bounded_integers(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if not params.disable_any_whitespace:
            options["whitespace_pattern"] = params.whitespace_pattern or WHITESPACE
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "choice":        # one lexeme (the lexer's automaton), not a grammar rule of as many alternatives:
        # the parser refuses rows of more than 2,000, and builds large ones slowly
        return llguidance.LLMatcher.grammar_from_regex("|".join(_literal(c) for c in params.choice))
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    return llguidance.grammar_from("grammar", params.grammar)     # GBNF (::= rules) or Lark


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _literal(text: str) -> str:
    """`text` as a regex that matches exactly it (the regex crate's escapes)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


def _closed(schema, every: bool, in_all_of: bool = False):
    """The schema with additionalProperties false on the objects that do not say otherwise: those that list
    properties (every=False; xgrammar's strict mode, vLLM's default backend), or every object (every=True).
    Without `every`, objects that take part in an allOf stay as they are (closing one branch would refuse the
    properties another branch names)."""
    if isinstance(schema, list):
        return [_closed(s, every, in_all_of) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = rewrite_subschemas(schema, lambda sub, key: _closed(sub, every, key == "allOf"))
    lists = "properties" in out
    if every:
        close = out.get("type") == "object" or lists
    else:
        close = lists and not in_all_of and "allOf" not in out and "patternProperties" not in out and \
            "unevaluatedProperties" not in out
    if close and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _bounded_integers(schema):
    """The schema with JSON's interoperable integer range, -(2^53 - 1) to 2^53 - 1 (RFC 8259 section 6: the
    integers every JSON parser reads exactly), as the bounds of each integer that does not set its own on that
    side: at most 16 digits, so that a sampled answer cannot write digits until max_tokens (as llama.cpp's
    grammars hold an integer part to 16 digits). A bound the schema sets is kept, and none is added that would
    leave its range empty."""
    if isinstance(schema, list):
        return [_bounded_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = rewrite_subschemas(schema, lambda sub, key: _bounded_integers(sub))
    kinds = out.get("type")
    if kinds == "integer" or (isinstance(kinds, list) and "integer" in kinds):
        low = next((out[k] for k in ("minimum", "exclusiveMinimum") if _is_number(out.get(k))), None)
        high = next((out[k] for k in ("maximum", "exclusiveMaximum") if _is_number(out.get(k))), None)
        if high is None and (low is None or low < JSON_SAFE_INTEGER):
            out["maximum"] = JSON_SAFE_INTEGER
        if low is None and (high is None or high > -JSON_SAFE_INTEGER):
            out["minimum"] = -JSON_SAFE_INTEGER
    return out


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


JSON_SAFE_INTEGER = 2 ** 53 - 1


class Grammar:
    """One sequence's matcher. It follows the sequence's output tokens (advanced on the tokens the sequence
    accepted, rolled back if they shrink), and gives the mask of the next token: only what keeps the output a
    prefix of the language, and EOS only where the language may end. After EOS it constrains nothing more."""
    __slots__ = ("matcher", "backend", "consumed", "ended", "error", "numbers")

    def __init__(self, matcher, backend: "GrammarBackend", numbers: NumberDigits | None = None):
        self.matcher, self.backend = matcher, backend
        self.consumed = 0          # output tokens the matcher took
        self.ended = False         # it took an EOS
        self.error: str | None = None
        self.numbers = numbers     # JSON constraints: where the output is in a number, for the digits' bounds

    @property
    def constrains(self) -> bool:
        return not self.ended and self.error is None

    def advance(self, token_ids: list[int], num_prompt_tokens: int) -> str | None:
        """Bring the matcher to the sequence's output; returns an error when a token is outside the language
        (another knob left the mask nothing to choose, or the grammar hit one of its limits)."""
        out = len(token_ids) - num_prompt_tokens
        if out < self.consumed:
            self.matcher.rollback(self.consumed - out)
            if self.numbers is not None:
                self.numbers.pop(self.consumed - out)
            self.consumed, self.ended = out, False
        if self.error is not None or self.ended:
            return self.error
        eos = self.backend.eos
        for t in token_ids[num_prompt_tokens + self.consumed:]:
            if not self.matcher.consume_token(t):
                raw = readable(self.matcher.get_error())
                self.error = (f"output token {self.consumed + 1} (id {t}) does not continue the structured output"
                              if not raw or "doesn't satisfy" in raw else
                              failure(raw, f"at output token {self.consumed + 1}"))
                return self.error
            self.consumed += 1
            if self.numbers is not None:
                self.numbers.push(t)
            if t in eos:
                self.ended = True
                break
        return None


class CompiledGrammar:
    __slots__ = ("matcher", "backend", "limits")

    def __init__(self, matcher, backend: "GrammarBackend", limits: DigitLimits | None = None):
        self.matcher, self.backend, self.limits = matcher, backend, limits

    def new(self) -> Grammar:
        numbers = None if self.limits is None else NumberDigits.start(self.limits, self.backend.token_digits())
        return Grammar(self.matcher.deep_copy(), self.backend, numbers)


class _Job:
    """One compile of one constraint, shared by every request that asks for it while it is queued or running."""
    __slots__ = ("params", "size", "future", "waiters", "abandoned")

    def __init__(self, params: StructuredOutputsParams):
        self.params, self.size = params, len(params.spec)
        self.future: Future = Future()
        self.waiters = 0              # requests still waiting for it (their deadlines not passed)
        self.abandoned = False        # every one of them gave up: drop it, or stop it at its next stage


class Pending:
    """One request's wait for a compile: ready once the compile is done, or once this request's own deadline has
    passed (`result` then gives the request its error, and the compile is dropped if nobody else waits for it)."""
    __slots__ = ("job", "deadline", "backend", "gone")

    def __init__(self, job: _Job, deadline: float, backend: "GrammarBackend"):
        self.job, self.deadline, self.backend, self.gone = job, deadline, backend, False

    @property
    def future(self) -> Future:
        return self.job.future

    def ready(self) -> bool:
        return self.job.future.done() or time.monotonic() >= self.deadline

    def result(self, wait: bool = True) -> "CompiledGrammar":
        """The compiled constraint (waiting for it until the deadline if `wait`); ValueError if it is invalid,
        uses what the backend does not implement, or is not done by this request's deadline."""
        try:
            return self.job.future.result(timeout=max(self.deadline - time.monotonic(), 0.0) if wait else 0.0)
        except (TimeoutError, CancelledError):
            self.give_up()
            raise ValueError(f"structured_outputs.{self.job.params.kind} did not compile within the time limit of "
                             f"{self.backend.timeout:g} s (the engine's grammar_compile_timeout)") from None

    def give_up(self) -> None:
        """This request no longer waits (its deadline passed, or it was aborted)."""
        self.backend._give_up(self)


class GrammarBackend:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, timeout: float):
        self.hf_tokenizer, self.vocab_size, self.timeout = tokenizer, vocab_size, timeout
        eos = tuple(eos_token_ids) or ((tokenizer.eos_token_id,) if tokenizer is not None and
                                       tokenizer.eos_token_id is not None else ())
        self.eos = frozenset(eos)
        self.words = (vocab_size + 31) // 32        # int32 words of one mask (the tokenizer's size if larger)
        self._tokenizer = None
        self._token_digits: TokenDigits | None = None
        self._lock, self._tokenizer_lock = threading.Lock(), threading.Lock()
        self._work = threading.Condition(self._lock)
        self._queues: dict[str, list] = {"small": [], "large": []}    # heaps of (size, order, job)
        self._order = itertools.count()
        self._lanes: list[threading.Thread] = []
        self._closed = False
        self._mask_thread: ThreadPoolExecutor | None = None   # a step's masks, during the forward
        self._cache: OrderedDict[tuple, _Job] = OrderedDict()
        self.mask_steps, self.masks_filled, self.mask_seconds = 0, 0, 0.0     # fill_masks' lifetime cost

    def submit(self, params: StructuredOutputsParams) -> Pending:
        """Start (or join) the compile of a validated constraint; this request waits for it at most the engine's
        grammar_compile_timeout from now."""
        if self.hf_tokenizer is None:
            raise ValueError("structured_outputs needs the model's tokenizer; this model directory has none")
        key = params.key
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar backend is closed")
            job = self._cache.get(key)
            if job is not None and not job.abandoned:
                self._cache.move_to_end(key)
            else:
                job = self._cache[key] = _Job(params)
                lane = "small" if job.size <= SMALL_SPEC_CHARS else "large"
                heapq.heappush(self._queues[lane], (job.size, next(self._order), job))
                if not self._lanes:
                    self._lanes = [threading.Thread(target=self._serve_lane, args=(name,), daemon=True,
                                                    name=f"nanovllm-grammar-{name}") for name in self._queues]
                    for t in self._lanes:
                        t.start()
                self._work.notify_all()
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            if not job.future.done():
                job.waiters += 1
        return Pending(job, time.monotonic() + self.timeout, self)

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled constraint, waiting at most the time limit; ValueError if it is invalid, uses what the
        backend does not implement, or missed the time limit (a verdict for this request only: a later request
        with the same constraint compiles it anew, or joins the compile still running)."""
        return self.submit(params).result()

    def _give_up(self, pending: Pending) -> None:
        with self._lock:
            job = pending.job
            if pending.gone or job.future.done():
                pending.gone = True
                return
            pending.gone = True
            job.waiters -= 1
            if job.waiters > 0:
                return
            job.abandoned = True            # a queued job is skipped; a running one stops at its next stage
            if self._cache.get(job.params.key) is job:
                del self._cache[job.params.key]
            job.future.cancel()             # only while queued (a running future cannot be cancelled)

    def _serve_lane(self, lane: str) -> None:
        """One compile thread. The small lane takes constraints of at most SMALL_SPEC_CHARS, smallest first, so
        that a small one never queues behind large ones; the large lane takes the others, smallest first, and
        small ones when it has nothing else."""
        while True:
            with self._work:
                job = self._next_job(lane)
                while job is None:
                    if self._closed:
                        return
                    self._work.wait()
                    job = self._next_job(lane)
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(self._compile(job))
            except BaseException as exc:       # a compile error is the constraint's verdict, kept in the cache
                job.future.set_exception(exc)

    def _next_job(self, lane: str) -> _Job | None:
        for name in ("small",) if lane == "small" else ("large", "small"):
            queue = self._queues[name]
            while queue:
                job = heapq.heappop(queue)[2]
                if not job.abandoned:
                    return job
        return None

    def _compile(self, job: _Job) -> CompiledGrammar:
        """Build the matcher, then try its start (the first mask and the bytes every output must begin with), so
        that a constraint that accepts nothing, or runs into the parser's limits at once, is refused here rather
        than while generating. llguidance cannot stop a build midway: an abandoned job stops between stages."""
        import llguidance
        params = job.params
        text = grammar_text(params)
        self._check_abandoned(job)
        matcher = llguidance.LLMatcher(self.tokenizer(), text, log_level=0,
                                       limits=llguidance.LLParserLimits(verbose_errors=False))
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {readable(matcher.get_error())}")
        self._check_abandoned(job)
        self._try_start(matcher, params.kind)
        limits = limits_of(params.kind, params.spec)
        if limits is not None:
            self.token_digits()
        return CompiledGrammar(matcher, self, limits)

    @staticmethod
    def _check_abandoned(job: _Job) -> None:
        if job.abandoned:
            raise CancelledError()

    def _try_start(self, matcher, kind: str) -> None:
        import llguidance.numpy
        probe = matcher.deep_copy()
        mask = np.zeros((1, self.words), np.int32)
        llguidance.numpy.fill_next_token_bitmask(probe, mask, 0)
        if not probe.is_error():
            forced = probe.compute_ff_tokens()
            if not probe.is_error() and forced:
                probe.consume_tokens(forced)
        if probe.is_error():
            raise ValueError(f"structured_outputs.{kind}: {failure(probe.get_error(), START)}")

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

    def token_digits(self) -> TokenDigits:
        """Each token's bytes and leading digits, for the bounds on JSON numbers (built once, on the first JSON
        compile)."""
        tokenizer = self.tokenizer()
        with self._tokenizer_lock:
            if self._token_digits is None:
                size = self.words * 32
                self._token_digits = TokenDigits(
                    [b"" if t >= size or tokenizer.is_special_token(t) else tokenizer.decode_bytes([t])
                     for t in range(min(size, tokenizer.vocab_size))], self.words)
            return self._token_digits

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
            if g.error is None:
                llguidance.numpy.fill_next_token_bitmask(g.matcher, masks, i)
                if g.matcher.is_error():  # the next token hit one of the parser's limits, or nothing can follow
                    g.error = failure(g.matcher.get_error(), f"at output token {g.consumed + 1}")
                elif g.numbers is not None and g.constrains:
                    g.numbers.restrict(masks[i])
                    if not masks[i].any():
                        g.error = (f"no token can continue the output at output token {g.consumed + 1} within "
                                   "the bounds on a JSON number's digits")
            if g.error is not None:       # the request ends with its error after this step (LLM._advance_grammar):
                masks[i] = 0              # its row samples an EOS meanwhile, never from an empty mask
                for t in self.eos:
                    masks[i, t >> 5] |= np.int32(np.uint32(1 << (t & 31)).view(np.int32))
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
        with self._lock:
            self._closed = True
            for queue in self._queues.values():
                for _, _, job in queue:
                    job.abandoned = True
                    job.future.cancel()
                queue.clear()
            self._work.notify_all()
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=False, cancel_futures=True)
        self._mask_thread = None


def readable(error: str) -> str:
    """llguidance's error without its debugging tail (a backtrace, the non-verbose marker)."""
    for tail in ("\n<backtrace>", "\n<non-verbose/>", "\n<state>"):
        error = error.split(tail)[0]
    error = error.strip()
    if error.startswith("panic: assertion failed: grammar.symbols.len()"):
        return "the grammar is larger than the backend can hold (more than 65,000 symbols)"
    return error


def failure(error: str, where: str) -> str:
    """Why a constraint cannot go on (`where`: at the start, or after N tokens), for the client."""
    error = readable(error)
    if error.startswith("NoExtensionBias"):
        return ("it accepts no output at all (no string matches it)" if where == START else
                f"no token can continue the output {where}")
    return f"the grammar backend's limits were hit {where}: {error}"
