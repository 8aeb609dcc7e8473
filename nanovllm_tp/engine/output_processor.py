"""Rank 0's side of a request after sampling: incremental detokenization, stop strings, and RequestOutputs
(cumulative, delta or final only). Torch-free.

Text grows token by token. Each new token is decoded in a small window with the tokens before it (so a leading
space or a multi-byte character split across tokens comes out right) and is only added once the window no
longer ends in an incomplete character. With a fast tokenizer the window moves inside the tokenizers library
(its DecodeStream, the same rule, one call per token); a request's end, and other tokenizers, decode the window
here. Stop strings are searched in the newly added text plus the tail that a
stop string could straddle; while a request runs, the last len(longest stop) - 1 characters are held back, so
nothing past a stop is ever emitted.

With a stream interval N > 1 (the request's stream_interval, raised to the engine's), a running completion is
reported once its first tokens arrive and then once N tokens have come since its last report (as in vLLM); its end
is always reported at once. Fewer, larger outputs cost less to send per token.
"""
from nanovllm_tp.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanovllm_tp.sampling_params import RequestOutputKind, SamplingParams
from nanovllm_tp.scheduler.scheduled_step import PositionLogprob

try:
    from tokenizers.decoders import DecodeStream
except ImportError:          # tokenizers < 0.21
    DecodeStream = None

_CONTEXT_TOKENS = 6      # prompt tokens that seed the first decode window


class Detokenizer:
    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset", "text", "skip_special", "backend", "stream")

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.text = ""
        self.skip_special = skip_special_tokens
        # A prompt that ends inside a character (a prompt of ids can): its last tokens are decoded again with the
        # completion, so the character (or the replacement of a broken one) is the completion's, whichever way the
        # text is decoded (token by token here or in the library, or at once at the end).
        read = len(self.ids)
        while read > 0 and self._decode(self.ids[:read]).endswith("\ufffd"):
            read -= 1
        self.prefix_offset, self.read_offset = 0, read
        self.backend = getattr(tokenizer, "_tokenizer", None) if DecodeStream is not None else None
        self.stream = None           # made on the first incremental token, seeded with the same context

    def _step(self) -> None:
        """The last token of ids through the tokenizers library's DecodeStream. Our offsets follow its window, so
        the end (or a fall-back after an error) goes on where it stands."""
        if self.stream is None:
            self.stream = DecodeStream(skip_special_tokens=self.skip_special)
            for t in self.ids[self.prefix_offset:-1]:
                self.stream.step(self.backend, t)
        piece = self.stream.step(self.backend, self.ids[-1])
        if piece is not None:
            self.text += piece
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special, clean_up_tokenization_spaces=False)

    def add(self, token_ids: list[int], final: bool = False) -> int:
        """Append tokens; returns how many characters the text grew by. `final` decodes them in one go and
        flushes an incomplete tail."""
        before = len(self.text)
        if final:
            self.ids.extend(token_ids)
            self._advance(True)
        else:
            for t in token_ids:
                self.ids.append(t)
                if self.backend is not None:
                    try:
                        self._step()
                        continue
                    except Exception:    # the library refused the window: it is decoded here from now on
                        self.backend = None
                self._advance(False)
        return len(self.text) - before

    def _advance(self, final: bool) -> None:
        if self.read_offset == len(self.ids):
            return
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)


class _Completion:
    __slots__ = ("seq", "detok", "num_detok", "sent_chars", "sent_tokens", "sent_logprobs", "sent_finish")

    def __init__(self, seq, detok: Detokenizer):
        self.seq, self.detok = seq, detok
        self.num_detok = 0                     # completion tokens given to the detokenizer
        self.sent_chars = self.sent_tokens = self.sent_logprobs = 0
        self.sent_finish = False               # a delta output carried its finish: it is never reported again


class RequestState:
    """One request (its n completions) on rank 0, between the engine and the caller."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seqs: list, tokenizer, token_texts, incremental: bool = True, stream_interval: int = 1,
                 resumed: list | None = None):
        """incremental=False: nobody reads the text before the request ends (no stop strings, only its final
        output is wanted), so it is decoded once at the end. `resumed`: the ResumedChoice of each of seqs (a
        request taken over from another engine): their tokens so far are decoded now and count as sent, and so
        do the characters of their text that the client has seen."""
        self.request_id, self.prompt, self.prompt_ids, self.params = request_id, prompt, prompt_ids, params
        self.interval = stream_interval
        self.incremental = incremental or bool(params.stop_strings)
        self.completions = [_Completion(s, Detokenizer(tokenizer, prompt_ids, params.skip_special_tokens))
                            for s in seqs]
        self.token_texts = token_texts         # ids -> a token id -> text map holding them, for logprobs
        self.hold = max((len(s) for s in params.stop_strings), default=1) - 1 \
            if not params.include_stop_str_in_output else 0
        for c, ch in zip(self.completions, resumed or ()):
            c.detok.add(ch.token_ids)
            c.num_detok = c.sent_tokens = c.sent_logprobs = len(ch.token_ids)
            c.sent_chars = min(ch.sent_chars, len(c.detok.text))
        self.sent_prompt_logprobs = resumed is not None

    @property
    def finished(self) -> bool:
        return all(c.seq.is_finished for c in self.completions)

    def update(self, seq) -> tuple[str, int] | None:
        """Detokenize what seq generated since the last call. A stop string matched in it is returned with the
        number of completion tokens that reach it (the text is already cut there); the caller ends the sequence
        there, even one that has just finished by length. Tokens are matched one at a time, so of a step that
        added several (speculative decoding) none after the stop string is kept."""
        if not (self.incremental or seq.is_finished):
            return None
        c = next(c for c in self.completions if c.seq is seq)
        ids = seq.completion_token_ids
        done, new = c.num_detok, ids[c.num_detok:]
        p = self.params
        stopped_by_token = seq.finish_reason == "stop" and not isinstance(seq.stop_reason, str)
        if new and stopped_by_token and not p.include_stop_str_in_output:
            new = new[:-1]                      # an EOS / stop id ends the request without its text
        c.num_detok = len(ids)
        if not p.stop_strings or stopped_by_token:
            c.detok.add(new, final=seq.is_finished)
            return None
        for i, t in enumerate(new):
            grew = c.detok.add([t], final=seq.is_finished and i == len(new) - 1)
            if done + i + 1 > p.min_tokens and (stop := self._match_stop(c.detok, grew)) is not None:
                return stop, done + i + 1
        if not new and seq.is_finished:
            c.detok.add([], final=True)
        return None

    def _match_stop(self, detok: Detokenizer, grew: int) -> str | None:
        p, text = self.params, detok.text
        longest = max(len(s) for s in p.stop_strings)
        start = max(0, len(text) - grew - longest + 1)
        best = None
        for stop in p.stop_strings:
            i = text.find(stop, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        detok.text = text[:i + len(stop)] if p.include_stop_str_in_output else text[:i]
        detok.prefix_offset = detok.read_offset = len(detok.ids)     # nothing after the stop is decoded
        return stop

    def output(self, full: bool = False) -> RequestOutput | None:
        """This request's output now, per its output_kind (full: everything, whatever the kind)."""
        kind = RequestOutputKind.CUMULATIVE if full else self.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = kind == RequestOutputKind.DELTA
        completions = self.completions
        if self.interval > 1 and not full and not finished:
            due = [c for c in completions if self._due(c)]
            if not due:
                return None
            if delta:                         # a cumulative output holds every completion
                completions = due
        outs = [o for o in (self._completion(c, delta) for c in completions) if o is not None]
        prompt_lp = None
        if self.completions[0].seq.prompt_logprobs is not None and not (delta and self.sent_prompt_logprobs):
            entries = self.completions[0].seq.prompt_logprobs[1:]
            prompt_lp = [None] + self._positions(self.prompt_ids[1:1 + len(entries)], entries)
            self.sent_prompt_logprobs = True
        if delta and not outs and not finished:
            return None
        seq = self.completions[0].seq
        metrics = RequestMetrics(seq.arrival_time, min((c.seq.first_token_time for c in self.completions
                                                        if c.seq.first_token_time is not None), default=None),
                                 max((c.seq.last_token_time or 0.0 for c in self.completions), default=None) or None,
                                 max((c.seq.finish_time or 0.0 for c in self.completions)) if finished else None,
                                 sum(c.seq.num_completion_tokens for c in self.completions))
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, prompt_lp, outs, finished, metrics)

    def _due(self, c: _Completion) -> bool:
        """Whether c is reported now under the stream interval: its first tokens, its end, or interval new ones."""
        return c.sent_tokens == 0 or c.seq.is_finished or c.seq.num_completion_tokens - c.sent_tokens >= self.interval

    def _completion(self, c: _Completion, delta: bool) -> CompletionOutput | None:
        seq, text = c.seq, c.detok.text
        visible = len(text) if seq.is_finished else max(c.sent_chars, len(text) - self.hold)
        ids = seq.completion_token_ids
        lps = seq.logprobs
        start_chars, start_tokens, start_lps = (c.sent_chars, c.sent_tokens, c.sent_logprobs) if delta else (0, 0, 0)
        if delta and (c.sent_finish or visible == c.sent_chars and len(ids) == c.sent_tokens and not seq.is_finished):
            return None       # nothing new (a finished completion of n > 1 while its siblings run: nothing ever)
        c.sent_finish = delta and seq.is_finished
        c.sent_chars, c.sent_tokens = visible, len(ids)
        c.sent_logprobs = len(lps) if lps is not None else 0
        logprobs = None
        if lps is not None:
            logprobs = self._positions(ids[start_lps:len(lps)], lps[start_lps:])
        return CompletionOutput(
            index=seq.index, text=text[start_chars:visible], token_ids=ids[start_tokens:],
            cumulative_logprob=seq.cumulative_logprob if lps is not None else None, logprobs=logprobs,
            finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
            error=seq.grammar.error if seq.finish_reason == "abort" and seq.grammar is not None else None)

    def _positions(self, ids: list[int], entries: list[PositionLogprob]) -> list[dict[int, Logprob]]:
        """{token id: Logprob} for each position: the chosen token, then the top-N (ranks 1..N) not already in."""
        text = self.token_texts([t for token_id, e in zip(ids, entries) for t in (token_id, *e.top_ids)])
        out = []
        for token_id, e in zip(ids, entries):
            position = {token_id: Logprob(e.logprob, e.rank, text[token_id])}
            for r, (t, v) in enumerate(zip(e.top_ids, e.top_logprobs), 1):
                if t not in position:
                    position[t] = Logprob(v, r, text[t])
            out.append(position)
        return out
