"""This rank's place in the tensor-parallel group, and the two collectives the layers need."""
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanovllm_tp.distributed.shm_allreduce import installed as _shm_installed
from nanovllm_tp.utils import trace


@dataclass(slots=True)
class TPState:
    rank: int = 0
    size: int = 1
    group: object = None      # torch ProcessGroup, None when size == 1


_tp = TPState()


def set_tp(rank: int, size: int, group=None) -> None:
    _tp.rank, _tp.size, _tp.group = rank, size, group


def current_tp() -> TPState:
    return TPState(_tp.rank, _tp.size, _tp.group)


@contextlib.contextmanager
def tp_scope(state: TPState):
    """Run with ``state`` as this process's TP state, then restore the previous one: lets a TP = 1 engine
    live beside the (one) multi-rank engine of the process without either seeing the other's group."""
    saved = current_tp()
    set_tp(state.rank, state.size, state.group)
    try:
        yield
    finally:
        set_tp(saved.rank, saved.size, saved.group)


def tp_rank() -> int:
    return _tp.rank


def tp_size() -> int:
    return _tp.size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _tp.size > 1:
        with trace.span("all_reduce"):      # mostly the wait for the slowest rank
            shm = _shm_installed()     # same-node CPU ranks: shared memory beats gloo's TCP by ~10x
            if shm is not None and shm.fits(x):
                return shm.all_reduce(x)
            dist.all_reduce(x, group=_tp.group)
    return x


def gather_last_dim_to_rank0(x: torch.Tensor) -> torch.Tensor | None:
    """Concatenate every rank's shard along the last dim on rank 0; other ranks get None."""
    if _tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_tp.size)] if _tp.rank == 0 else None
    with trace.span("gather_logits"):
        dist.gather(x.contiguous(), parts, dst=dist.get_global_rank(_tp.group, 0) if _tp.group else 0,
                    group=_tp.group)
    return torch.cat(parts, dim=-1) if _tp.rank == 0 else None
