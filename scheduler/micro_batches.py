"""Pipeline micro-batches: several steps in flight at once, so that every pipeline stage has work. Torch-free.

Under pipeline parallelism a step's stages run one after another; with one step in flight each stage idles while
the others work. MicroBatchScheduler keeps up to `count` steps in flight, one per part: each part is a Scheduler
of its own (its own waiting and running queues, its own decode batch and preemption), and every part draws on one
BlockManager, so the KV budget and the prefix cache are the engine's, shared. A request joins the part with the
fewest unfinished sequences (its n > 1 siblings start in the same part), and a sequence is only ever in its part's
step, so never in two steps in flight: its next token depends on the last. When the part about to be scheduled runs
at least two sequences more than a part with no step in flight (the tail of a batch: one part's requests have
ended, the other's run on), running sequences move over, so that both keep a step in flight; neither part has a
step in flight then, and a sequence's blocks are the shared pool's, so nothing else moves.

Why this is safe without more bookkeeping:
- a part schedules only while it has no step in flight, and frees (preemption, finish) only its own sequences'
  blocks, so no block a step in flight reads or writes goes back to the pool before that step's results are in;
- a prompt's blocks enter the prefix cache in postprocess, after the last stage has run the step that computed
  them, so a hit in another part never reads KV still being written;
- every rank runs plans in the order rank 0 publishes them, so the KV that one step writes into a block is there
  before any later step reads that block, on every stage.

A finish from outside (an abort, most often a client that went away) of a sequence whose part has a step in flight
waits for that step's results: it is applied in postprocess, and the sequence is among those reported then.

The interface is the Scheduler's (add, finish, schedule, postprocess, abort_all, the counters), with schedule()
callable again while earlier steps are in flight and postprocess() taking the oldest one's results.
"""
from collections import deque

import numpy as np

from nanovllm_tp.scheduler.block_manager import BlockManager
from nanovllm_tp.scheduler.scheduled_step import ScheduledStep
from nanovllm_tp.scheduler.scheduler import Scheduler, SchedulerConfig
from nanovllm_tp.scheduler.sequence import Sequence


class MicroBatchScheduler:
    """Up to `count` disjoint steps in flight, each a part's; the parts share one block pool."""

    def __init__(self, config: SchedulerConfig, count: int):
        if count < 2:
            raise ValueError(f"micro-batches need at least 2 parts, got {count}")
        self.config = config
        self.block_manager = BlockManager(config.num_kvcache_blocks, config.kvcache_block_size,
                                          config.enable_prefix_caching, config.kv_window)
        self.parts = [Scheduler(config, block_manager=self.block_manager) for _ in range(count)]
        self.lora_slots = None          # LoRA is refused under pipeline parallelism (pipeline_checks.py)
        self.step_id = 0                # the engine's step ids: one sequence over every part
        self._order: deque[Scheduler] = deque()     # parts with a step in flight, oldest first
        self._next = 0                  # the part asked first by the next schedule()
        self._pending: dict[int, list[tuple]] = {}   # id(part) -> finishes waiting for its step's results
        self.max_in_flight = 0          # lifetime: the most steps that were in flight at once
        self.num_moved = 0              # lifetime: running sequences moved to an idle part

    mark_aborted = staticmethod(Scheduler.mark_aborted)

    # the queues and counters, over every part

    @property
    def waiting(self) -> list[Sequence]:
        return [seq for part in self.parts for seq in part.waiting]

    @property
    def running(self) -> list[Sequence]:
        return [seq for part in self.parts for seq in part.running]

    @property
    def num_in_flight(self) -> int:
        return len(self._order)

    def _total(self, name: str):
        return sum(getattr(part, name) for part in self.parts)

    num_preemptions = property(lambda self: self._total("num_preemptions"))
    num_mixed_steps = property(lambda self: self._total("num_mixed_steps"))
    num_computed_tokens = property(lambda self: self._total("num_computed_tokens"))
    num_draft_tokens = property(lambda self: self._total("num_draft_tokens"))
    num_accepted_tokens = property(lambda self: self._total("num_accepted_tokens"))
    num_accepted_per_position = property(lambda self: np.sum([p.num_accepted_per_position for p in self.parts],
                                                             axis=0))

    def has_unfinished(self) -> bool:
        return any(part.has_unfinished() for part in self.parts)

    def add(self, seq: Sequence) -> None:
        """Queue a request in the part with the fewest unfinished sequences (the first of equals)."""
        min(self.parts, key=lambda part: len(part.waiting) + len(part.running)).add(seq)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None,
               num_completion_tokens: int | None = None) -> None:
        """Scheduler.finish, at once when seq's part has no step in flight, else when that step's results are in."""
        part = self._part_of(seq)
        if part is None:          # finished already, or never added: Scheduler.finish settles what it can
            part = self.parts[0]
        if part.scheduled:
            self._pending.setdefault(id(part), []).append((seq, reason, stop_reason, num_completion_tokens))
        else:
            part.finish(seq, reason, stop_reason, num_completion_tokens)

    def _part_of(self, seq: Sequence) -> Scheduler | None:
        """The part whose queues hold seq (a step's rows stay in their part's running or waiting queue)."""
        for part in self.parts:
            if any(s is seq for s in part.running) or any(s is seq for s in part.waiting):
                return part
        return None

    def schedule(self) -> ScheduledStep | None:
        """The next step of a part that has none in flight (the parts take turns), or None when no such part has
        anything to run. Raises when nothing is in flight and nothing can run while sequences are unfinished."""
        count, bm = len(self.parts), self.block_manager
        while True:
            free = bm.num_free_blocks
            for i in range(count):
                part = self.parts[(self._next + i) % count]
                if part.scheduled or not part.has_unfinished():
                    continue
                self._share_with_idle(part)
                part.step_id = self.step_id
                step = part.schedule()
                if step is None:
                    continue
                self.step_id = part.step_id
                self._next = (self.parts.index(part) + 1) % count
                self._order.append(part)
                self.max_in_flight = max(self.max_in_flight, len(self._order))
                return step
            if self._order or not self.has_unfinished():
                return None
            # nothing in flight and nothing ran: a part asked early may have lacked blocks that a later one's
            # preemptions have freed since; ask again, unless the pass freed nothing
            if bm.num_free_blocks == free:
                raise RuntimeError(f"scheduler stalled with {len(self.waiting)} waiting and {len(self.running)} "
                                   "running sequences")

    def _share_with_idle(self, part: Scheduler) -> None:
        """Move running sequences from `part` (about to be scheduled) to parts with no step in flight that run at
        least two fewer, the most recently admitted first, until they are even."""
        for other in self.parts:
            if other is part or other.scheduled:
                continue
            moved = 0
            while len(part.running) - len(other.running) >= 2:
                other.running.append(part.running.pop())
                moved += 1
            if moved:
                part.decode_batch = other.decode_batch = None
                self.num_moved += moved

    def rows_in_flight(self) -> list[list[Sequence]]:
        """The sequences of each step in flight (the plan's rows, in order), oldest step first."""
        return [list(part.scheduled) for part in self._order]

    def oldest(self) -> ScheduledStep | None:
        """The step in flight whose results postprocess() takes next."""
        return self._order[0].in_flight if self._order else None

    def postprocess(self, token_ids: list[int], logprobs=None, prompt_logprobs=None, pooled=None) -> list[Sequence]:
        """Scheduler.postprocess for the oldest step in flight, then the finishes that waited for it."""
        if not self._order:
            raise RuntimeError("postprocess() without a scheduled step")
        part = self._order.popleft()
        progressed = part.postprocess(token_ids, logprobs, prompt_logprobs, pooled)
        for seq, *args in self._pending.pop(id(part), ()):
            part.finish(seq, *args)
            if not any(s is seq for s in progressed):
                progressed.append(seq)
        return progressed

    def abort_all(self) -> list[Sequence]:
        """Every part's unfinished sequences dropped, their blocks freed (used when a step fails)."""
        self._order.clear()
        self._pending.clear()
        return [seq for part in self.parts for seq in part.abort_all()]
