"""Who joins a step: the waiting prompts that fit what the running rows leave of the token and sequence budget
(FCFS, only the first prefill of a step chunked), and whether the head of waiting could join at all. A part of
Scheduler."""
from nanovllm_tp.scheduler.sequence import Sequence, SequenceStatus


class Admission:
    """Mixed into Scheduler: uses its config, queues, block manager and LoRA slots."""

    def _waiting_head_fits(self) -> bool:
        """Whether the next waiting sequence could join a step next to the running ones (else the step stays a
        pure decode step, on the fast path)."""
        cfg, head = self.config, self.waiting[0]
        if len(self.running) >= min(cfg.max_num_seqs, cfg.max_num_batched_tokens):
            return False
        if head.block_table:
            return True
        return self._slot_for(head) and self.block_manager.can_allocate(head) is not None

    def _slot_for(self, seq: Sequence, take: bool = False) -> bool:
        """Whether seq's adapter has (take: gets) a slot; always for the base model."""
        slots = self.lora_slots
        return seq.lora is None or slots is None or (slots.acquire(seq) if take else slots.can_acquire(seq))

    def _schedule_prefill(self, reserved: int = 0) -> list[Sequence]:
        """Waiting sequences for what is left after `reserved` decode rows (one token and one row each)."""
        cfg, bm = self.config, self.block_manager
        seqs, budget_used = [], reserved
        while self.waiting and len(seqs) + reserved < cfg.max_num_seqs:
            remaining = cfg.max_num_batched_tokens - budget_used
            if remaining == 0:
                break
            seq = self.waiting[0]
            hits = None
            if not seq.block_table:
                hits = bm.can_allocate(seq) if self._slot_for(seq) else None
                if hits is None:
                    break          # FCFS: nothing behind the head may jump it (nor a head short of a LoRA slot)
                num_tokens = seq.num_tokens - len(hits) * self.block_size
            else:
                num_tokens = seq.num_tokens - seq.num_cached_tokens
            if num_tokens > remaining and seqs:
                break              # only the first prefill of a step is chunked
            if hits is not None:
                self._slot_for(seq, take=True)
                bm.allocate(seq, hits)
            seq.num_scheduled_tokens = min(num_tokens, remaining)
            budget_used += seq.num_scheduled_tokens
            if seq.num_cached_tokens + seq.num_scheduled_tokens == seq.num_tokens:
                seq.status = SequenceStatus.RUNNING
                self.waiting.popleft()
                self.running.append(seq)
            seqs.append(seq)
        return seqs
