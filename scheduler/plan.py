"""StepPlan: the one thing that crosses from the scheduler to the workers.

Flat numpy arrays and ints only; encoded with msgpack (each array as dtype, shape, raw bytes), never pickled.
Rows are sequences, tokens are the flattened new tokens of all rows in row order. Sampling state never travels:
it stays on rank 0 (scheduler/rows.py).
"""
from dataclasses import dataclass, fields

import msgpack
import numpy as np

PREFILL, DECODE, MIXED = 0, 1, 2


@dataclass(slots=True)
class StepPlan:
    step_id: int
    kind: int                  # PREFILL: prompt chunks (some KV may be cached); DECODE: one token per row;
                               # MIXED: decode rows first, then prompt chunks
    input_ids: np.ndarray      # int64 [tokens]
    positions: np.ndarray      # int64 [tokens]
    slot_mapping: np.ndarray   # int64 [tokens]   KV cache slot = block_id * block_size + offset
    cu_seqlens_q: np.ndarray   # int32 [rows + 1] new tokens per row, cumulated
    context_lens: np.ndarray   # int32 [rows]     KV length per row after this step (cached + new)
    block_tables: np.ndarray   # int32 [rows, max_blocks] padded with -1
    prompt_logits: np.ndarray | None = None   # bool [rows]: logits at every token of the row, not just its last
                                              # (prompt logprobs); None = last token of every row
    block_copies: np.ndarray | None = None    # int32 [copies, 2]: (src, dst) blocks copied in every layer before
                                              # the forward (a forked sequence's partly filled last block)

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_prefill(self) -> bool:
        """Rows of any length (the varlen path); False only for pure decode steps."""
        return self.kind != DECODE

    def encode(self) -> bytes:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                value = [value.dtype.str, list(value.shape), np.ascontiguousarray(value).tobytes()]
            out[f.name] = value
        return msgpack.packb(out, use_bin_type=True)

    @classmethod
    def decode(cls, data: bytes) -> "StepPlan":
        raw = msgpack.unpackb(data, raw=False)
        kwargs = {}
        for f in fields(cls):
            value = raw.get(f.name)
            if isinstance(value, list):
                dtype, shape, buf = value
                value = np.frombuffer(buf, dtype=np.dtype(dtype)).reshape(shape)
            kwargs[f.name] = value
        return cls(**kwargs)
