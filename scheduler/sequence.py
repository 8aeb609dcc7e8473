"""A request as the scheduler sees it: tokens so far, how many have KV, and the blocks holding that KV."""
import time
from enum import IntEnum


class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    __slots__ = ("seq_id", "status", "token_ids", "num_prompt_tokens", "num_cached_tokens",
                 "num_scheduled_tokens", "block_table", "temperature", "max_tokens", "ignore_eos",
                 "seed", "finish_reason",
                 "arrival_time", "first_token_time", "finish_time")

    def __init__(self, seq_id: int, token_ids: list[int], *, temperature: float = 0.0,
                 max_tokens: int = 16, ignore_eos: bool = False, seed: int = 0):
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0       # tokens whose KV is in the cache
        self.num_scheduled_tokens = 0    # tokens computed in the step being run
        self.block_table: list[int] = []
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self.ignore_eos = ignore_eos
        self.seed = seed
        self.finish_reason: str | None = None
        # perf_counter() timestamps, for latency figures (TTFT, TPOT)
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[i * block_size:(i + 1) * block_size])

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")
