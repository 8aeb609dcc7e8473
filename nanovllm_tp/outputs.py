"""Results with vLLM's shape: RequestOutput.outputs[i].text / .token_ids / .logprobs / .finish_reason."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None             # 1 = the most likely token at that position
    decoded_token: str | None = None


# One position's logprobs: the chosen token and the top-N, by token id.
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None      # None unless logprobs were asked for
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None             # "stop", "length" or "abort"; None while running
    stop_reason: int | str | None = None         # the stop string or stop token id that ended it (None for EOS)
    error: str | None = None                     # why an "abort" ended it, where the engine knows (a grammar's)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """time.perf_counter() timestamps of one request."""
    arrival_time: float
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_generation_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token_time is None or self.last_token_time is None or self.num_generation_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_generation_tokens - 1)


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    metrics: RequestMetrics | None = None


def merge_delta(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """Two successive DELTA outputs of one request as one: each completion's text, tokens and logprobs joined,
    the later one's state (finish, cumulative logprob, metrics) kept. Modifies and returns `earlier`."""
    by_index = {c.index: c for c in earlier.outputs}
    for c in later.outputs:
        mine = by_index.get(c.index)
        if mine is None:
            earlier.outputs.append(c)
            by_index[c.index] = c
            continue
        mine.text += c.text
        mine.token_ids = mine.token_ids + c.token_ids
        if c.logprobs is not None:
            mine.logprobs = (mine.logprobs or []) + c.logprobs
        mine.cumulative_logprob, mine.finish_reason, mine.stop_reason, mine.error = \
            c.cumulative_logprob, c.finish_reason, c.stop_reason, c.error
    if earlier.prompt_logprobs is None:
        earlier.prompt_logprobs = later.prompt_logprobs
    earlier.finished, earlier.metrics = later.finished, later.metrics
    return earlier
