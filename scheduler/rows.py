"""The per-row arrays rank 0 keeps for the rows of a step: sampling knobs and stop limits, declared once.

Each Sequence carries its record (`row_record`, built once from its SamplingParams); a step's rows are one
`np.fromiter` over those records into the structured ROW_DTYPE, and the decode batch filters the same array.
A new sampling knob is a SamplingParams field, a line here, and its op in the sampler.

What changes single logits before the draw reaches the sampler as one list per step (`SamplingBatch.modifiers`),
items of (entry, token, kind, value) that the C pass and the numpy/torch sampler both apply, in this order:
ALLOW (the entry samples among its ALLOW tokens only: every other logit is -inf), MASK (a grammar's bitmask:
token is a row of `Modifiers.masks`, and every token whose bit is clear is -inf), BIAS (+ value), PENALTY (the
row's repetition, presence and frequency penalties; value: the token's count in the output), SUPPRESS (-inf).
That is vLLM's order (allowed set and grammar; bad words, min_tokens and logit bias; penalties): -inf stays -inf
through what comes after it, and the bias comes before the penalties. A logit knob of a request is a list of such
items (`request_modifiers`) and no change to either sampler.
The stop rule (`finish_codes`) is here too, so prefill, mixed and decode steps finish requests the same way.
"""
from dataclasses import dataclass

import numpy as np

_NO_LIMIT = np.iinfo(np.int64).max
_TOP_K_OFF = np.iinfo(np.int32).max

ROW_DTYPE = np.dtype([
    ("temperature", np.float32), ("top_p", np.float32), ("top_k", np.int32), ("min_p", np.float32),
    ("presence_penalty", np.float32), ("frequency_penalty", np.float32), ("repetition_penalty", np.float32),
    ("seed", np.int64), ("logprobs", np.int32),           # logprobs: -1 = none
    ("max_tokens", np.int64), ("min_tokens", np.int64), ("ignore_eos", np.bool_),
    ("has_stop_ids", np.bool_),                          # stop_token_ids are checked per row in Python
    ("modifiers", np.bool_),                             # logit knobs of its own: request_modifiers
])

# Finish codes, per row
RUNNING, STOP_EOS, STOP_TOKEN, LENGTH = 0, 1, 2, 3
# Kinds of logit modifiers (csrc/sampler.c has the same numbers)
PENALTY, SUPPRESS, BIAS, ALLOW, MASK = 0, 1, 2, 3, 4


def row_record(params, seed: int) -> tuple:
    """One request's entry, in ROW_DTYPE's field order."""
    special = {"seed": seed, "top_k": min(max(params.top_k, 0), _TOP_K_OFF),    # beyond any vocabulary: off
               "logprobs": -1 if params.logprobs is None else params.logprobs,
               "max_tokens": _NO_LIMIT if params.max_tokens is None else params.max_tokens,
               "has_stop_ids": bool(params.stop_token_ids),
               "modifiers": params.logit_bias is not None or params.allowed_token_ids is not None
               or bool(params.bad_words) or params.structured_outputs is not None}
    return tuple(special[name] if name in special else getattr(params, name) for name in ROW_DTYPE.names)


def rows_of(seqs) -> np.ndarray:
    return np.fromiter((s.row for s in seqs), ROW_DTYPE, len(seqs))


def request_modifiers(seq) -> list[tuple[np.ndarray, int, np.ndarray | float]]:
    """(token ids, kind, value) of a sequence's own logit knobs this step: its allowed set, its biases, and the
    last token of each bad word whose other tokens end its output (vLLM's rule: the output only, not the prompt)."""
    params, items = seq.params, []
    if params.allowed_array is not None:
        items.append((params.allowed_array, ALLOW, 0.0))
    if params.bias_arrays is not None:
        items.append((params.bias_arrays[0], BIAS, params.bias_arrays[1]))
    if params.bad_words:
        words = params.bad_words_token_ids
        if words is None:
            raise RuntimeError("bad_words are tokenized when LLM admits a request (SamplingParams.tokenize_bad_words)")
        tokens, out = seq.token_ids, seq.num_completion_tokens
        last = tokens[-1] if out else -1
        banned = [ids[-1] for ids in words if len(ids) == 1 or (
            len(ids) <= out + 1 and ids[-2] == last and tuple(tokens[len(tokens) + 1 - len(ids):]) == ids[:-1])]
        if banned:
            items.append((np.asarray(banned, np.int64), SUPPRESS, 0.0))
    return items


@dataclass(slots=True)
class Modifiers:
    """A step's logit modifiers grouped by entry: entry e's items are [start[e], start[e + 1]), in no set order."""
    start: np.ndarray    # int64 [entries + 1]
    token: np.ndarray    # int64 [items]: the token (MASK: the row of masks)
    kind: np.ndarray     # int32 [items]: PENALTY, SUPPRESS, BIAS, ALLOW or MASK
    value: np.ndarray    # float32 [items]: PENALTY: the token's count in the output; BIAS: the bias; else 0
    masks: np.ndarray | None = None    # int32 [masks, words]: grammars' bitmasks (bit t of a row: token t allowed)

    @property
    def entry(self) -> np.ndarray:
        return np.repeat(np.arange(len(self.start) - 1), np.diff(self.start))


class SeenTokens:
    """A sequence's distinct tokens and how often each occurs in its output, for the penalties. Kept on the
    sequence and brought up to date from its tokens when read (they only grow, preemption included), so a
    step costs the tokens added since the last one, not the whole history."""
    __slots__ = ("ids", "out_counts", "size", "slot", "upto")

    def __init__(self):
        self.ids = np.zeros(64, np.int64)
        self.out_counts = np.zeros(64, np.float32)
        self.size, self.slot, self.upto = 0, {}, 0     # slot: token id -> its index in ids

    def update(self, token_ids: list[int], num_prompt: int) -> tuple[np.ndarray, np.ndarray]:
        for pos in range(self.upto, len(token_ids)):
            t = token_ids[pos]
            i = self.slot.get(t)
            if i is None:
                if self.size == len(self.ids):
                    self.ids = np.concatenate([self.ids, np.zeros_like(self.ids)])
                    self.out_counts = np.concatenate([self.out_counts, np.zeros_like(self.out_counts)])
                i = self.slot[t] = self.size
                self.ids[i] = t
                self.size += 1
            if pos >= num_prompt:
                self.out_counts[i] += 1
        self.upto = len(token_ids)
        return self.ids[:self.size], self.out_counts[:self.size]


@dataclass(slots=True)
class SamplingBatch:
    """What rank 0's sampler needs for one step: one entry per row that produces a token this step."""
    seqs: list                    # the Sequence each entry's token goes to
    rows: np.ndarray              # ROW_DTYPE [entries]
    sample_index: np.ndarray      # int64 [entries]: tokens generated before this one (the noise counter)
    logits_index: np.ndarray | None = None   # int64 [entries]: the logits row each entry reads (None: i -> i)
    pending_masks: tuple | None = None       # (entries, a future of their grammar masks): start_masks()

    def __len__(self) -> int:
        return len(self.seqs)

    def penalty_tokens(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(entry, token id, times in the output) for each distinct token, prompt or output, of the sequences of
        the entries with a penalty (repetition, presence or frequency), in entry order."""
        rows = self.rows
        entries = np.flatnonzero((rows["repetition_penalty"] != 1) | (rows["presence_penalty"] != 0)
                                 | (rows["frequency_penalty"] != 0))
        ids, counts, sizes = [], [], []
        seqs = self.seqs
        for e in entries.tolist():
            seq = seqs[e]
            seen = seq.seen
            if seen is None:
                seen = seq.seen = SeenTokens()
            if seen.upto != len(seq.token_ids):
                seen.update(seq.token_ids, seq.num_prompt_tokens)
            ids.append(seen.ids[:seen.size])
            counts.append(seen.out_counts[:seen.size])
            sizes.append(seen.size)
        if not sizes:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
        return np.repeat(entries, sizes), np.concatenate(ids), np.concatenate(counts)

    def modifiers(self, eos: np.ndarray, vocab: int) -> Modifiers | None:
        """Every logit modifier of the step's entries (None: there are none): penalties, min_tokens suppression,
        each request's own knobs; tokens outside [0, vocab) are left out."""
        entry, token, kind, value = [], [], [], []

        def add(e, t, k, v):
            entry.append(e if isinstance(e, np.ndarray) else np.full(len(t), e, np.int64))
            token.append(t)
            kind.append(np.full(len(t), k, np.int32))
            value.append(v if isinstance(v, np.ndarray) else np.full(len(t), v, np.float32))

        e, t, counts = self.penalty_tokens()
        if len(e):
            add(e, t, PENALTY, counts)
        e, t = self.suppressed(eos)
        if len(e):
            add(e, t, SUPPRESS, 0.0)
        for e in self.rows["modifiers"].nonzero()[0].tolist():       # nonzero: no copy of the strided field
            for t, k, v in request_modifiers(self.seqs[e]):
                add(e, t, k, v)
        masked, masks = self.grammar_masks()
        if masked:
            add(np.asarray(masked, np.int64), np.arange(len(masked), dtype=np.int64), MASK, 0.0)
        if not entry:
            return None
        if len(entry) == 1:
            entry, token, kind, value = entry[0], token[0], kind[0], value[0]
        else:
            entry, token, kind, value = (np.concatenate(a) for a in (entry, token, kind, value))
            order = np.argsort(entry, kind="stable")
            entry, token, kind, value = entry[order], token[order], kind[order], value[order]
        keep = ((token >= 0) & (token < vocab)) | (kind == MASK)
        if not keep.all():
            entry, token, kind, value = entry[keep], token[keep], kind[keep], value[keep]
        start = np.zeros(len(self) + 1, np.int64)
        np.cumsum(np.bincount(entry, minlength=len(self)), out=start[1:])
        return Modifiers(start, token, kind, value, masks)

    def _grammars(self) -> tuple[list[int], list]:
        """The entries whose sequence's grammar constrains this token, and (grammar, sequence) pairs of them."""
        entries, pairs = [], []
        for e in self.rows["modifiers"].nonzero()[0].tolist():
            seq = self.seqs[e]
            if seq.grammar is not None and seq.grammar.constrains:
                entries.append(e)
                pairs.append((seq.grammar, seq))
        return entries, pairs

    def start_masks(self) -> None:
        """Start filling the grammar masks on the backend's own thread, so that they are made while the model
        runs (the engine calls this before the forward; modifiers() waits for them)."""
        entries, pairs = self._grammars()
        if pairs:
            self.pending_masks = (entries, pairs[0][0].backend.fill_masks_soon(pairs))

    def grammar_masks(self) -> tuple[list[int], np.ndarray | None]:
        """(entries, their grammar bitmasks [entries, words]): those start_masks began, else made now."""
        if self.pending_masks is not None:
            entries, future = self.pending_masks
            return entries, future.result()
        entries, pairs = self._grammars()
        return entries, (pairs[0][0].backend.fill_masks(pairs) if pairs else None)

    def suppressed(self, eos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(entry, token id) pairs that may not be sampled: EOS and stop ids of rows still under min_tokens."""
        rows = self.rows
        under = self.sample_index < rows["min_tokens"]
        if not under.any():
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        with_eos = np.flatnonzero(under & ~rows["ignore_eos"])
        entries, ids = [np.repeat(with_eos, len(eos))], [np.tile(eos, len(with_eos))]
        for e in np.flatnonzero(under & rows["has_stop_ids"]).tolist():
            stops = self.seqs[e].params.stop_token_ids
            entries.append(np.full(len(stops), e, np.int64))
            ids.append(np.asarray(stops, np.int64))
        entries, ids = np.concatenate(entries), np.concatenate(ids)
        if len(entries) > len(with_eos) * len(eos):          # stop ids after the EOS pairs: back in entry order
            order = np.argsort(entries, kind="stable")
            entries, ids = entries[order], ids[order]
        return entries, ids


def finish_codes(seqs, rows: np.ndarray, tokens: np.ndarray, completion: np.ndarray, total: np.ndarray,
                 eos: np.ndarray, max_model_len: int) -> np.ndarray:
    """Finish code of each row after it appended `tokens` (now `completion` generated, `total` in all).
    EOS and stop ids count once min_tokens are out; EOS wins over a stop id, which wins over length."""
    may_stop = completion > rows["min_tokens"]
    codes = np.where((completion >= rows["max_tokens"]) | (total >= max_model_len), LENGTH, RUNNING)
    for r in np.flatnonzero(rows["has_stop_ids"] & may_stop).tolist():
        if int(tokens[r]) in seqs[r].params.stop_token_ids:
            codes[r] = STOP_TOKEN
    eos_hit = np.isin(tokens, eos) & ~rows["ignore_eos"] & may_stop
    codes[eos_hit] = STOP_EOS
    return codes
