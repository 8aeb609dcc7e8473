"""Who waits in front and who is preempted first: vLLM's two scheduling policies. Torch-free.

fcfs: arrival order. A new sequence joins the back of waiting, a preempted one goes back to its front, and when
blocks run out the newest running sequence is preempted first.
priority: by (priority, arrival), lower first (vLLM's rule). Waiting is kept in that order, the running sequence
with the largest key is preempted first, and a waiting sequence may preempt running ones of a lower priority to
start at once.
Either way, a prompt part-way through its chunks stays at the head of waiting (it holds blocks; only the head may).
"""
from collections import deque


def key(seq) -> tuple[int, int]:
    """The priority order: lower first; sequence ids grow with arrival (siblings of one request share theirs)."""
    return seq.priority, seq.seq_id


def enqueue(waiting: deque, seq, by_priority: bool, front: bool) -> None:
    """Put seq into waiting: at the back (a new one) or the front (a preempted one) under fcfs, in key order under
    priority; never ahead of a head that holds blocks."""
    first = 1 if waiting and waiting[0].block_table else 0
    if not by_priority:
        if front:
            waiting.insert(first, seq)
        else:
            waiting.append(seq)
        return
    k, i = key(seq), first
    while i < len(waiting) and key(waiting[i]) <= k:
        i += 1
    waiting.insert(i, seq)


def victim(running: deque, current, by_priority: bool):
    """The sequence to preempt so that `current` (taken off running's front) can grow: the newest running one
    under fcfs, the one with the largest key under priority (current itself when it has)."""
    if not by_priority:
        return running[-1] if running else current
    return max([*running, current], key=key)


def lower_priority_running(running: deque, head):
    """Under priority: the running sequence of the largest key, if it ranks below the waiting head (else None)."""
    last = max(running, key=key, default=None)
    return last if last is not None and key(last) > key(head) else None
