"""The request log: one INFO line in the HTTP process's log when the server accepts a request, one when it ends,
and one for a request refused before it reached the engine (a 4xx):

    Received request cmpl-3: route=/v1/completions, prompt_tokens=6, max_tokens=16, n=1, stream=False
    Finished request cmpl-3: finish_reason=length, prompt_tokens=6, generation_tokens=16, seconds=0.412, ttft=0.051
    Finished request chatcmpl-4: client disconnected, finish_reason=abort, prompt_tokens=20, generation_tokens=3, ...
    Refused request POST /v1/completions: status=400, reason='max_tokens must be at least 1, got 0'

No prompt text by default (prompts are the clients' business); `--max-log-len N` adds the first prompt's first N
characters (`prompt='...'`, its repr: one line whatever it holds). A request's end is the final output of each of
its engine requests (EngineClient.on_finished, which /metrics counts too): its finish reasons (`stop:3,length:1`
when its choices differ), tokens summed over its prompts and choices, seconds from its submission to its last
final output, and the engine's time to first token (the smallest of its prompts'; /metrics' TTFT). A client that
goes away has its requests aborted: their final outputs (finish reason abort) end the line with `client
disconnected`. A request the engine cannot finish (it stopped) ends with the status its client got (503) at once.

Nothing here runs per token or per chunk: a dict entry per open request, one line at each end. `serve
--disable-log-requests` (vLLM's flag, or --no-enable-log-requests) turns it off.
"""
import logging
import time
from dataclasses import dataclass, field

log = logging.getLogger("nanovllm_tp")
REASON_WORDS, REASON_CHARS = 12, 100      # how much of a refusal's message the line keeps


@dataclass(slots=True)
class OpenRequest:
    """An accepted request whose end is not logged yet."""
    request_id: str
    started: float                  # time.monotonic() when it was handed to the engine
    waiting: int                    # its engine requests (one per prompt) whose final output has not come
    prompt_tokens: int
    generation_tokens: int | None = None       # None: no generating output came (an embedding)
    reasons: dict = field(default_factory=dict)    # finish reason -> completions that ended so
    ttft: float | None = None
    disconnected: bool = False


def first_words(message: str) -> str:
    """The start of a refusal's message: at most REASON_WORDS words and REASON_CHARS characters."""
    words = message.split()
    text = " ".join(words[:REASON_WORDS])
    if len(text) > REASON_CHARS:
        text = text[:REASON_CHARS]
    return text if text == " ".join(words) else text + " ..."


class RequestLog:
    def __init__(self, max_log_len: int | None = None, tokenizer=None):
        """`max_log_len`: characters of the first prompt each accepted line shows (None: no prompt text);
        `tokenizer`: to show a prompt that came as token ids (a chat's rendered template)."""
        self.max_log_len, self.tokenizer = max_log_len, tokenizer
        self.open: dict[str, OpenRequest] = {}

    def accepted(self, request_id: str, route: str, prompts: list[list[int]], params, texts=None,
                 started: float | None = None) -> None:
        """A request handed to the engine (its engine requests are `{request_id}-{i}`, one per prompt); `texts`:
        the prompts as the client wrote them, where it wrote text."""
        tokens = sum(len(p) for p in prompts)
        self.open[request_id] = OpenRequest(request_id, time.monotonic() if started is None else started,
                                            len(prompts), tokens)
        parts = [f"route={route}", f"prompt_tokens={tokens}"]
        if len(prompts) > 1:
            parts.append(f"prompts={len(prompts)}")
        if hasattr(params, "max_tokens"):                 # generating (not an embedding's PoolingParams)
            kind = getattr(params.output_kind, "name", "")
            parts += [f"max_tokens={params.max_tokens}", f"n={params.n}", f"stream={kind == 'DELTA'}"]
        if self.max_log_len is not None and prompts:
            parts.append(f"prompt={self._prompt_start(prompts[0], texts[0] if texts else None)!r}")
        log.info("Received request %s: %s", request_id, ", ".join(parts))

    def _prompt_start(self, ids: list[int], text: str | None) -> str:
        n = self.max_log_len
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(ids[:n])         # a token holds at least one character, mostly
        return (text or "")[:n]

    def finished(self, out) -> None:
        """An engine request's final output (EngineClient.on_finished): the last one of its request logs the
        end."""
        entry = self.open.get(out.request_id.rpartition("-")[0])
        if entry is None:
            return
        m = getattr(out, "metrics", None)
        if m is not None:
            entry.generation_tokens = (entry.generation_tokens or 0) + m.num_generation_tokens
            if m.ttft is not None:
                entry.ttft = m.ttft if entry.ttft is None else min(entry.ttft, m.ttft)
        completions = out.outputs if isinstance(out.outputs, list) else ()
        for c in completions:
            reason = c.finish_reason or "abort"
            entry.reasons[reason] = entry.reasons.get(reason, 0) + 1
        entry.waiting -= 1
        if entry.waiting <= 0:
            self._end(entry)

    def client_gone(self, request_id: str) -> None:
        """Its client went away and its engine requests were aborted: their final outputs end the line."""
        entry = self.open.get(request_id)
        if entry is not None:
            entry.disconnected = True

    def failed(self, request_id: str, status: int, message: str) -> None:
        """It ended with an error status (the engine stopped): no final output will come."""
        entry = self.open.get(request_id)
        if entry is not None:
            self._end(entry, f"status={status} ({first_words(message)})")

    def _end(self, entry: OpenRequest, status: str | None = None) -> None:
        del self.open[entry.request_id]
        parts = [status] if status else []
        if entry.disconnected and status is None:
            parts.append("client disconnected")
        if entry.reasons:          # one reason alone; several as reason:choices
            counts = entry.reasons
            parts.append("finish_reason=" + (next(iter(counts)) if len(counts) == 1 else
                                             ",".join(f"{r}:{k}" for r, k in counts.items())))
        parts.append(f"prompt_tokens={entry.prompt_tokens}")
        if entry.generation_tokens is not None:
            parts.append(f"generation_tokens={entry.generation_tokens}")
        parts.append(f"seconds={time.monotonic() - entry.started:.3f}")
        if entry.generation_tokens is not None or entry.ttft is not None:
            parts.append(f"ttft={'-' if entry.ttft is None else format(entry.ttft, '.3f')}")
        log.info("Finished request %s: %s", entry.request_id, ", ".join(parts))

    def refused(self, method: str, path: str, status: int, message: str) -> None:
        """A request answered with a 4xx before the engine had it (a bad body, a limit, a wrong key)."""
        log.info("Refused request %s %s: status=%d, reason=%r", method, path, status, first_words(message))
