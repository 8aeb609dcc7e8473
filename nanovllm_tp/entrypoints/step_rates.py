"""The prompt and decode rates a generate() progress bar shows: tokens so far over the seconds their steps took so
far, one running average per kind of step (a mixed step, prompt chunks beside decode rows, counts as prefill). A
step that ran nothing (no request ready) counts for neither."""
from dataclasses import dataclass


@dataclass(slots=True)
class StepRates:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def add(self, num_tokens: int, is_prefill: bool, seconds: float) -> None:
        """One step's tokens (the engine's count: prompt tokens computed, or one per decode row) and wall time."""
        if num_tokens <= 0:
            return
        if is_prefill:
            self.prefill_tokens += num_tokens
            self.prefill_seconds += seconds
        else:
            self.decode_tokens += num_tokens
            self.decode_seconds += seconds

    @property
    def prefill_rate(self) -> float:
        """Prompt tokens per second so far (0 before the first prefill)."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_rate(self) -> float:
        """Decoded tokens per second so far (0 before the first decode step)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else 0.0

    def postfix(self) -> dict[str, str]:
        """The progress bar's fields: prefill=...tok/s, decode=...tok/s."""
        return {"prefill": f"{self.prefill_rate:.0f}tok/s", "decode": f"{self.decode_rate:.0f}tok/s"}
