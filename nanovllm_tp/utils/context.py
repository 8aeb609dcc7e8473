"""Per-step batch metadata, set by the runner so that model code stays forward(input_ids, positions)."""
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Context:
    is_prefill: bool = False
    cu_seqlens_q: torch.Tensor | None = None     # int32 [rows + 1]
    cu_seqlens_k: torch.Tensor | None = None     # int32 [rows + 1]
    max_seqlen_q: int = 0
    max_seqlen_k: int = 0
    slot_mapping: torch.Tensor | None = None     # int64 [tokens]
    context_lens: torch.Tensor | None = None     # int32 [rows]
    block_tables: torch.Tensor | None = None     # int32 [rows, width]
    has_cached_prefix: bool = False               # some row attends to KV it did not compute this step
    context_lens_cpu: list[int] | None = None     # host copies so the torch backend can slice without syncs
    q_lens_cpu: list[int] | None = None
    logits_indices: torch.Tensor | None = None    # int64: tokens the LM head computes (None: each row's last)
    as_decode: tuple | None = None                # torch backend: (rows, token index or None, Context) of the
                                                  # rows it runs as decode rows (() if none), made once a step


_context = Context()


def get_context() -> Context:
    return _context


def set_context(ctx: Context) -> None:
    global _context
    _context = ctx


def reset_context() -> None:
    global _context
    _context = Context()
