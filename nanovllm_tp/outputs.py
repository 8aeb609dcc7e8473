"""Results with vLLM's shape: RequestOutput.outputs[0].text / .token_ids / .finish_reason."""
from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None      # "stop" (EOS) or "length" (max_tokens / max_model_len)


@dataclass(slots=True)
class RequestMetrics:
    """time.perf_counter() timestamps of one request."""
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    metrics: RequestMetrics | None = None
