"""StepPlan: the one thing that crosses from the scheduler to the workers.

Flat numpy arrays and ints only; encoded with msgpack (each array as dtype, shape, raw bytes), never pickled.
Rows are sequences, tokens are the flattened new tokens of all rows in row order. Sampling state never travels:
it stays on rank 0 (scheduler/rows.py).
"""
import math
from dataclasses import dataclass, fields

import msgpack
import numpy as np

PREFILL, DECODE, MIXED = 0, 1, 2
# not steps: KV blocks moved between the ranks and rank 0 for a request that leaves or enters the engine with its KV
# (engine/kv_transfer.py); such a plan has no rows, only kv_blocks
KV_READ, KV_WRITE = 3, 4
# dtype and rank every decoded array must have; arrays of fields not listed here need only be numeric
ARRAY_SPECS = {"input_ids": ("<i8", 1), "positions": ("<i8", 1), "slot_mapping": ("<i8", 1),
               "cu_seqlens_q": ("<i4", 1), "context_lens": ("<i4", 1), "block_tables": ("<i4", 2),
               "prompt_logits": ("|b1", 1), "block_copies": ("<i4", 2),
               "hidden_rows": ("|b1", 1), "lora_slot": ("<i4", 1), "kv_blocks": ("<i4", 1)}


def slot_mapping(block_tables: np.ndarray, rows: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """The KV slot of each token: the block its row holds at that position, times block_size, plus the offset."""
    return block_tables[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size


def lora_slots(seqs) -> np.ndarray | None:
    """The plan's lora_slot of these rows: each one's adapter slot (-1: base), None when no row has one."""
    slots = np.fromiter((s.lora_slot for s in seqs), np.int32, len(seqs))
    return slots if (slots >= 0).any() else None


class PlanError(ValueError):
    """A plan that a rank refuses to run: undecodable, or outside the rank's limits."""

    def __init__(self, step, field: str, text: str):
        super().__init__(f"plan for step {step}: {field}: {text}")
        self.step, self.field = step, field


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
    hidden_rows: np.ndarray | None = None     # bool [rows]: rows of embedding requests: no logits, their hidden
                                              # states kept on rank 0 for pooling; None = no such row
    lora_slot: np.ndarray | None = None       # int32 [rows]: each row's LoRA slot, -1 the base model; None: all base
    lora_loads: list | None = None            # [slot, lora_int_id, adapter directory] each rank loads before the
                                              # forward (the slot's previous adapter is dropped)
    kv_blocks: np.ndarray | None = None       # int32 [blocks], KV_READ: every rank sends rank 0 its part of these
                                              # blocks' KV; KV_WRITE: each rank writes the part rank 0 sends it
                                              # into them (workers/kv_blocks.py)

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

    @classmethod
    def moving_kv(cls, kind: int, step_id: int, blocks: list[int]) -> "StepPlan":
        """A KV_READ or KV_WRITE plan over these blocks: no rows, nothing computed."""
        none = np.zeros(0, np.int64)
        return cls(step_id, kind, none, none, none, np.zeros(1, np.int32), np.zeros(0, np.int32),
                   np.zeros((0, 0), np.int32), kv_blocks=np.asarray(blocks, np.int32))

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
        """Inverse of ``encode``; anything else raises PlanError (never another exception). Keys that are not
        fields are ignored. The arrays are read-only views of ``data``."""
        try:
            raw = msgpack.unpackb(data, raw=False)
        except Exception as exc:
            raise PlanError("?", "encoding", f"not a msgpack plan ({type(exc).__name__})") from None
        if not isinstance(raw, dict):
            raise PlanError("?", "encoding", f"a plan is a map, got {type(raw).__name__}")
        step = raw.get("step_id")
        step = step if type(step) is int else "?"
        kwargs = {}
        for f in fields(cls):
            value = raw.get(f.name)
            if value is None and f.default is None:        # an optional field left out
                kwargs[f.name] = None
                continue
            if f.name not in raw:
                raise PlanError(step, f.name, "missing")
            if f.name == "lora_loads":
                value = _loads(step, value)
            elif f.name in ARRAY_SPECS or isinstance(value, list):
                value = _array(step, f.name, value)
            elif type(value) is not int:
                raise PlanError(step, f.name, f"expected an int, got {type(value).__name__}")
            kwargs[f.name] = value
        return cls(**kwargs)


def _loads(step, value) -> list:
    if not isinstance(value, list) or not all(
            isinstance(v, list) and len(v) == 3 and type(v[0]) is int and type(v[1]) is int and isinstance(v[2], str)
            for v in value):
        raise PlanError(step, "lora_loads", "expected a list of [slot, id, path]")
    return value


def _array(step, name: str, value) -> np.ndarray:
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[0], str)
            and isinstance(value[1], list) and isinstance(value[2], bytes)):
        raise PlanError(step, name, "expected [dtype, shape, bytes]")
    dtype_str, shape, buf = value
    spec = ARRAY_SPECS.get(name)
    if spec is not None:
        if dtype_str != spec[0] or len(shape) != spec[1]:
            raise PlanError(step, name, f"expected dtype {spec[0]} with {spec[1]} dims, got {dtype_str} {shape}")
        dtype = np.dtype(dtype_str)
    else:
        try:
            dtype = np.dtype(dtype_str)
        except Exception:
            dtype = None
        if dtype is None or dtype.kind not in "biuf":
            raise PlanError(step, name, f"not a numeric dtype: {dtype_str[:40]!r}")
    if len(shape) > 8 or not all(type(d) is int and d >= 0 for d in shape):
        raise PlanError(step, name, f"bad shape {shape[:8]}")
    if math.prod(shape) * dtype.itemsize != len(buf):
        raise PlanError(step, name, f"{len(buf)} bytes do not make a {dtype_str} array of shape {shape}")
    return np.frombuffer(buf, dtype=dtype).reshape(shape)
