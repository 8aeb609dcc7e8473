"""A request as the scheduler sees it: tokens so far, how many have KV, the blocks holding that KV, and the
request's SamplingParams (held, not copied field by field)."""
import time
from enum import IntEnum

from nanovllm_tp.sampling_params import SamplingParams
from nanovllm_tp.scheduler.rows import row_record


class SequenceStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    __slots__ = ("seq_id", "status", "token_ids", "num_prompt_tokens", "num_cached_tokens",
                 "num_scheduled_tokens", "block_table", "num_window_freed", "params", "seed", "row", "forks", "index",
                 "finish_reason", "stop_reason", "logprobs", "cumulative_logprob", "prompt_logprobs",
                 "seen", "grammar", "pooling", "embedding", "draft", "spec_wait", "spec_misses", "priority",
                 "arrival_time", "first_token_time", "last_token_time", "finish_time", "lora", "lora_slot")

    def __init__(self, seq_id: int, token_ids: list[int], params: SamplingParams | None = None, *,
                 seed: int = 0, index: int = 0, priority: int = 0, grammar=None, pooling=None, lora=None,
                 output_ids=(), **sampling):
        """`sampling` builds the params when none are given (greedy, 16 tokens unless told otherwise). `pooling`
        (pooling_params.Pooling): an embedding request, prefill only: it samples nothing and ends with its prompt.
        `output_ids`: tokens this completion generated already (a request resumed from another engine): they count
        as its output (max_tokens, penalties, the sampler's noise counter) and are computed with the prompt, as
        after a preemption."""
        if params is None:
            params = SamplingParams(**{"temperature": 0.0, **sampling})
        elif sampling:
            raise TypeError("pass either params or sampling keyword arguments, not both")
        self.seq_id = seq_id
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.token_ids += output_ids
        self.num_cached_tokens = 0       # tokens whose KV is in the cache
        self.num_scheduled_tokens = 0    # tokens computed in the step being run
        self.block_table: list[int] = []
        self.num_window_freed = 0        # leading block_table entries released for the sliding window (stale)
        self.params = params
        self.seed = seed
        self.row = row_record(params, seed)     # this request's entry of the per-row sampling arrays
        self.forks: list[Sequence] = []         # siblings of an n > 1 request, started when this prefill ends
        self.index = index                      # which of the request's n completions this is
        self.finish_reason: str | None = None   # "stop", "length" or "abort"
        self.stop_reason: int | str | None = None
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.seen = None                        # rows.SeenTokens, made when a penalty first reads it
        self.grammar = grammar                  # structured outputs: its matcher (structured/backend.Grammar)
        self.pooling = pooling                  # embeddings: how the hidden states are pooled (None: generation)
        self.embedding = None                   # embeddings: the pooled sum so far, then the embedding (numpy)
        self.draft: list[int] = []              # proposed tokens computed in the step being run (speculative)
        self.spec_wait = 0                      # decode steps to skip proposing (after proposals that failed)
        self.spec_misses = 0                    # proposing steps in a row that accepted nothing
        self.priority = priority                # the request's; lower first under the priority policy
        self.lora = lora                        # its LoRARequest (None: the base model)
        self.lora_slot = -1                     # the adapter's slot while the sequence holds blocks (-1: none)
        # perf_counter() timestamps, for latency figures (TTFT, TPOT)
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
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
    def lora_id(self) -> int:
        """Its adapter's lora_int_id, 0 for the base model (the prefix cache's key)."""
        return 0 if self.lora is None else self.lora.lora_int_id

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def max_tokens(self) -> int | None:
        return self.params.max_tokens

    @property
    def ignore_eos(self) -> bool:
        return self.params.ignore_eos

    @property
    def wants_prompt_logits(self) -> bool:
        """Prompt logprobs need logits at every prompt position, so such a prompt is computed in full."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def computes_whole_prompt(self) -> bool:
        """No cached prefix may stand for part of the prompt: its prompt logprobs or its pooling read every token."""
        return self.wants_prompt_logits or (self.pooling is not None and self.pooling.needs_every_token)

    def num_blocks(self, block_size: int) -> int:
        return (len(self.token_ids) + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> tuple[int, ...]:
        return tuple(self.token_ids[i * block_size:(i + 1) * block_size])

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, {self.status.name}, tokens={self.num_tokens}, "
                f"cached={self.num_cached_tokens}, blocks={self.block_table})")
