"""Decode rows and preemption by recompute: each running sequence gets room for its next token, else the
policy's victim (fcfs: the tail of running) gives back its blocks and waits to compute its tokens again; under
the priority policy a waiting head preempts the running sequences that rank below it. A part of Scheduler."""
from nanovllm_tp.scheduler import policy
from nanovllm_tp.scheduler.sequence import Sequence, SequenceStatus


class Preemption:
    """Mixed into Scheduler: uses its config, queues and block manager, and counts num_preemptions."""

    def _schedule_decode(self) -> list[Sequence]:
        bm, seqs = self.block_manager, []
        max_rows = min(self.config.max_num_seqs, self.config.max_num_batched_tokens)   # one token per row
        while self.running and len(seqs) < max_rows:
            seq = self.running.popleft()
            while not bm.can_append(seq):
                out = policy.victim(self.running, seq, self.by_priority)
                if out is seq:
                    self._preempt(seq)
                    break
                self.running.remove(out)
                self._preempt(out)
            else:
                seq.num_scheduled_tokens = 1
                bm.may_append(seq)
                seqs.append(seq)
        self.running.extendleft(reversed(seqs))
        return seqs

    def _requeue_front(self, seq: Sequence) -> None:
        """Back into waiting as the policy says (fcfs: its front), behind a prompt part-way through its chunks."""
        policy.enqueue(self.waiting, seq, self.by_priority, front=True)

    def _preempt_for_head(self) -> None:
        """Under priority: running sequences that rank below the head of waiting are preempted (lowest first) until
        the head can start."""
        head, cfg = self.waiting[0], self.config
        while not head.block_table:
            out = policy.lower_priority_running(self.running, head)     # first: cheaper than the head's hashes
            if out is None or (len(self.running) < cfg.max_num_seqs
                               and self.block_manager.can_allocate(head) is not None):
                return
            self.running.remove(out)
            self._preempt(out)

    def _preempt(self, seq: Sequence) -> None:
        self.decode_batch = None
        seq.embedding = None          # an embedding request recomputed starts its sum again
        seq.status = SequenceStatus.WAITING
        self._free(seq)
        self._requeue_front(seq)
        self.num_preemptions += 1
