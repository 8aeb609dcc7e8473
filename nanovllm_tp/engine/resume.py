"""A request taken over from another engine: where each of its unfinished completions goes on.

A request's state outside its KV is small: its prompt ids and parameters (which the caller passes as for any
request), and per completion still running, the tokens it generated so far and how much of their text its client
has seen. `LLM.add_requests(..., resume=...)` queues such a request as if it had been preempted: its prompt and
those tokens are computed again (a prefix-cache hit where this engine holds them), and it goes on from there. The
tokens count as its output (max_tokens, penalties, stop rules), a structured output's matcher replays them, and
the sampler's noise counter is the number of tokens generated, so a seeded completion continues with the draws it
would have made; a completion's seed is the request's seed mixed with its index, as on the first engine (without a
seed, the new engine draws its own: a valid continuation, not the same one). Under batch_invariant a greedy
completion's tokens equal those of a run that never moved.

The same entry takes a request whose KV moves with it (engine/kv_transfer.py: `add_requests(resume=..., kv=...)`):
its completions that bring the KV of their tokens go on decoding at once, without computing them again; the others
are computed again as above. One path, two ways in.

Its outputs are delta outputs that start where the client's text stopped (`sent_chars` characters of the
completion's text: the text of the tokens may run ahead of what was shown, held back before a possible stop string
or an unfinished character) and hold only the completions resumed.
"""
from dataclasses import dataclass

from nanovllm_tp.utils.checks import integer


@dataclass(slots=True)
class ResumedChoice:
    index: int                 # which of the request's n completions
    token_ids: list[int]       # what it generated so far
    sent_chars: int = 0        # characters of its text the client has seen already

    def to_wire(self) -> list:
        return [self.index, self.token_ids, self.sent_chars]

    @classmethod
    def from_wire(cls, row) -> "ResumedChoice":
        if not isinstance(row, (list, tuple)) or len(row) != 3:
            raise ValueError(f"a resumed completion is [index, token_ids, sent_chars], got {row!r}")
        return cls(*row)


def check_resume(choices, n: int, prompt_len: int, max_tokens: int | None, max_model_len: int,
                 vocab_size: int) -> list[ResumedChoice]:
    """The resumed completions of one request, checked: a non-empty list of distinct indexes below n, each with
    token ids of the vocabulary that leave room to go on. Raises ValueError."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise ValueError("resume must be a non-empty list of ResumedChoice (the completions still running)")
    seen = set()
    for ch in choices:
        if not isinstance(ch, ResumedChoice):
            raise ValueError(f"resume holds ResumedChoice items, got {type(ch).__name__}")
        integer("resume index", ch.index, lo=0)
        integer("resume sent_chars", ch.sent_chars, lo=0)
        if ch.index >= n or ch.index in seen:
            raise ValueError(f"resume index {ch.index} is not one of the request's {n} completions, or is repeated")
        seen.add(ch.index)
        if not isinstance(ch.token_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in ch.token_ids):
            raise ValueError(f"resume token_ids of completion {ch.index} must be token ids below {vocab_size}")
        if max_tokens is not None and len(ch.token_ids) >= max_tokens:
            raise ValueError(f"completion {ch.index} has {len(ch.token_ids)} of its max_tokens={max_tokens} already: "
                             "nothing is left to resume")
        if prompt_len + len(ch.token_ids) >= max_model_len:
            raise ValueError(f"completion {ch.index} fills max_model_len={max_model_len} already")
    return list(choices)
