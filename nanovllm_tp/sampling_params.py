"""Per-request sampling knobs, with vLLM's names. Torch-free: the scheduler imports it."""
import math
from dataclasses import dataclass


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0     # 0 (or anything below 1e-5) means greedy
    max_tokens: int = 64
    ignore_eos: bool = False
    seed: int | None = None      # per-request seed; None draws one from the engine's seed

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise a ValueError/TypeError a user can act on; called again by generate() in case fields were edited."""
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)):
            raise TypeError(f"temperature must be a number, got {type(t).__name__}")
        if math.isnan(t) or math.isinf(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int):
            raise TypeError(f"max_tokens must be an int, got {type(m).__name__}")
        if m < 1:
            raise ValueError(f"max_tokens must be >= 1, got {m}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise TypeError(f"seed must be an int or None, got {type(s).__name__}")
        if s is not None and not 0 <= s < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {s}")
