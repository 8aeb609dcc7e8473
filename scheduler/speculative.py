"""Speculative decoding on rank 0: the configuration (vLLM's `speculative_config` dict), the n-gram proposer, and
the rules every proposer shares.

Proposals come from the n-gram lookup (below) or from a draft model (workers/draft_runner.py, which the scheduler
reaches through the `Proposer` interface only, staying torch-free). With the n-gram method a running request whose
context repeats itself gets up to k proposed tokens per step: the tokens that followed the earliest earlier
occurrence of its last n tokens (n from prompt_lookup_max down to prompt_lookup_min; vLLM's choice), or, when
the passage the last proposal came from is one of those occurrences, the tokens that follow there. The step then computes
1 + k positions of that row at once, and every position is sampled as a plain decode step would sample it (same
request seed, same token index): a proposed token is accepted while it equals the token sampled at its position,
and the first position that differs gives the request its next token. So the output is the one non-speculative
decoding gives, greedy or sampled, and a step yields 1 to k + 1 tokens.
"""
import os
from dataclasses import dataclass

import numpy as np

from nanovllm_tp.utils.checks import integer

# each method's keys besides method and num_speculative_tokens
METHODS = {"ngram": ("prompt_lookup_max", "prompt_lookup_min"),
           "draft_model": ("model", "draft_tensor_parallel_size")}
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = 0
    prompt_lookup_min: int = 0
    method: str = "ngram"
    model: str | None = None                # draft_model: the draft's checkpoint (directory or .gguf)

    @classmethod
    def from_dict(cls, d: dict | None, tensor_parallel_size: int = 1) -> "SpeculativeConfig | None":
        """Checked as vLLM reads it: method (without one: draft_model when a model is given, else ngram),
        num_speculative_tokens; for ngram prompt_lookup_max / _min (each defaults to the other, both to 5); for
        draft_model the draft's model and draft_tensor_parallel_size (1, the one this engine runs: the draft
        lives on rank 0)."""
        if d is None:
            return None
        if not isinstance(d, dict):
            raise TypeError(f"speculative_config must be a dict, got {type(d).__name__}")
        method = d.get("method") or ("draft_model" if "model" in d else "ngram")     # vLLM's inference
        if method not in METHODS:
            raise ValueError(f"speculative_config method {method!r} is not implemented (implemented: "
                             f"{', '.join(METHODS)})")
        known = ("method", "num_speculative_tokens") + METHODS[method]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} for method "
                             f"{method!r} (known: {', '.join(known)})")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs num_speculative_tokens")
        k = d["num_speculative_tokens"]
        integer("speculative_config num_speculative_tokens", k, 1, MAX_SPECULATIVE_TOKENS)
        if method == "draft_model":
            return cls(k, method=method, model=_draft_model(d, tensor_parallel_size))
        hi, lo = d.get("prompt_lookup_max"), d.get("prompt_lookup_min")
        hi, lo = (hi if hi is not None else lo if lo is not None else 5), (lo if lo is not None else hi or 5)
        integer("speculative_config prompt_lookup_max", hi, 1)
        integer("speculative_config prompt_lookup_min", lo, 1, hi)
        return cls(k, hi, lo, method)


def _draft_model(d: dict, tensor_parallel_size: int) -> str:
    """The draft's path; draft_tensor_parallel_size must be 1: the draft runs on rank 0 alone."""
    model = d.get("model")
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError("speculative_config method 'draft_model' needs model: the draft's checkpoint directory "
                        f"or .gguf file, got {type(model).__name__}")
    model = os.fspath(model)       # checked where it is loaded, on rank 0 (workers never read it)
    tp = d.get("draft_tensor_parallel_size", 1)
    integer("speculative_config draft_tensor_parallel_size", tp, 1)
    if tp != 1:
        raise ValueError(f"speculative_config draft_tensor_parallel_size={tp} is not implemented: the draft runs on "
                         f"rank 0 alone (draft_tensor_parallel_size=1), whatever the target's "
                         f"tensor_parallel_size ({tensor_parallel_size})")
    return model


def propose_ngram(tokens: np.ndarray, min_n: int, max_n: int, k: int, follow: int = -1) -> tuple[np.ndarray, int]:
    """(up to k tokens, where they start): the tokens that followed an earlier occurrence of the context's last n
    tokens, for the largest n in [min_n, max_n] that occurs; (empty, -1) when none does. The occurrence is the
    earliest, unless the one starting at `follow` (the proposer's source of the last step, moved on by the tokens
    since) is among them and still has k tokens after it: a copy keeps reading the passage it was reading, not
    the first place the last n tokens happen to occur too."""
    size = len(tokens)
    if k <= 0 or size < min_n + 1:
        return tokens[:0], -1
    last = tokens[-1]
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        # ends of earlier n-grams whose last token matches, then the whole n-gram, vectorized
        ends = np.flatnonzero(tokens[n - 1:size - 1] == last) + (n - 1)
        if n > 1 and len(ends):
            window = tokens[ends[:, None] - np.arange(n - 1, -1, -1)]
            ends = ends[(window == tokens[size - n:]).all(axis=1)]
        if len(ends):
            start = int(ends[0]) + 1
            if 0 < follow <= size - k and np.any(ends == follow - 1):
                start = follow
            return tokens[start:start + k], start
    return tokens[:0], -1


def speculates(params) -> bool:
    """Whether a request may take proposals: every knob it uses reads only the logits of its position (logprobs
    too: each kept position reports those of its own logits, as a plain decode step would). Penalties, bad words
    and a grammar read the tokens before it, which a proposed position does not have yet."""
    return (params.repetition_penalty == 1 and params.presence_penalty == 0 and params.frequency_penalty == 0
            and not params.bad_words and params.structured_outputs is None)


def wanting(seqs) -> list:
    """The running sequences that may take proposals this step. A sequence whose proposals were all rejected
    waits before proposing again (1, 3, 7, then 15 decode steps as misses repeat), so a stream the proposer
    cannot guess costs little."""
    out = []
    for seq in seqs:
        if seq.spec_wait:
            seq.spec_wait -= 1
        elif speculates(seq.params):
            out.append(seq)
    return out


class Proposer:
    """What the scheduler asks for proposals: `limits` (before the step's rows are chosen: the most tokens each
    running sequence would take, by seq_id; empty when none) and `propose` (after: the tokens of the chosen rows,
    whose KV blocks for those positions are allocated; `block_copies` are the (src, dst) block copies the step's
    plan will carry, not run yet)."""

    def limits(self, seqs) -> dict[int, int]:
        raise NotImplementedError

    def propose(self, seqs: list, ks: list[int], block_copies: list[tuple[int, int]]) -> list[list[int]]:
        raise NotImplementedError


class NgramProposer(Proposer):
    def __init__(self, spec: SpeculativeConfig):
        self.spec, self.found = spec, {}
        self.source: dict[int, int] = {}     # seq_id -> (where its last proposal started) - (context length then)

    def limits(self, seqs) -> dict[int, int]:
        spec, source = self.spec, self.source
        self.found, self.source = {}, {}
        for seq in wanting(seqs):
            size = seq.num_tokens
            follow = source[seq.seq_id] + size if seq.seq_id in source else -1
            tokens, start = propose_ngram(np.asarray(seq.token_ids, np.int64), spec.prompt_lookup_min,
                                          spec.prompt_lookup_max, spec.num_speculative_tokens, follow)
            if len(tokens):
                self.found[seq.seq_id] = tokens
                self.source[seq.seq_id] = start - size
        return {i: len(t) for i, t in self.found.items()}

    def propose(self, seqs: list, ks: list[int], block_copies) -> list[list[int]]:
        return [self.found[s.seq_id][:k].tolist() for s, k in zip(seqs, ks)]


def accept(entries: list, tokens: np.ndarray, per_position: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(mask of the sampling entries whose token is kept, tokens proposed, tokens accepted); `per_position[j]`
    counts the proposals accepted at place j of their draft. The entries of a sequence with a draft of k tokens
    are its 1 + k positions in order: the leading positions whose sampled token equals the proposed one are
    accepted, and the first that differs (or the last) gives one token more."""
    keep = np.ones(len(entries), np.bool_)
    proposed = accepted = i = 0
    while i < len(entries):
        seq = entries[i]
        k = len(seq.draft)
        if k:
            match = tokens[i:i + k] == np.asarray(seq.draft, np.int64)
            a = k if match.all() else int(np.argmin(match))
            keep[i + a + 1:i + k + 1] = False
            proposed, accepted = proposed + k, accepted + a
            per_position[:a] += 1
            seq.spec_misses = 0 if a else seq.spec_misses + 1
            seq.spec_wait = min(1 << seq.spec_misses, 16) - 1 if seq.spec_misses else 0
        i += k + 1
    return keep, proposed, accepted


def attach_drafts(seqs: list, limits: dict[int, int], proposer: Proposer, block_manager, config,
                  block_copies) -> bool:
    """Give the decode rows that may take proposals as many as the step's token budget, the request's limits and
    the free blocks allow (their KV slots are taken now), then the proposer's tokens; False when none got any."""
    bm, bs = block_manager, config.kvcache_block_size
    budget = config.max_num_batched_tokens - len(seqs)
    chosen, ks = [], []
    for seq in seqs:
        want = limits.get(seq.seq_id)
        if want is None or budget <= 0:
            continue
        limit = config.max_model_len - seq.num_tokens - 1
        if seq.max_tokens is not None:
            limit = min(limit, seq.max_tokens - seq.num_completion_tokens - 1)
        room = (len(seq.block_table) + bm.num_free_blocks) * bs - seq.num_tokens
        k = min(want, budget, limit, room)
        if k <= 0:
            continue
        while (seq.num_tokens - 1 + k) // bs >= len(seq.block_table):
            seq.block_table.append(bm.take_block())
        chosen.append(seq)
        ks.append(k)
        budget -= k
    if not chosen:
        return False
    for seq, tokens in zip(chosen, proposer.propose(chosen, ks, block_copies)):
        seq.draft = list(tokens)
        seq.num_scheduled_tokens = 1 + len(seq.draft)
    return any(s.draft for s in seqs)


def ordinals(entries: list) -> np.ndarray:
    """Each sampling entry's place among the consecutive entries of its sequence (0, 1, .. along a row with a
    draft; 0 elsewhere)."""
    out = np.zeros(len(entries), np.int64)
    for i in range(1, len(entries)):
        if entries[i] is entries[i - 1]:
            out[i] = out[i - 1] + 1
    return out
