"""Pipeline parallelism between ranks: this rank's stage, the process groups of the stages, and the point-to-point
transfers of a step's activations from stage to stage and of its logits back to rank 0.

A world of TP x PP ranks is laid out stage-major: global rank = stage * TP + TP rank, so stage 0's TP rank 0 is
rank 0 (the scheduler and the sampler) and the stages' TP groups are runs of consecutive ranks. Each TP rank t
has a pipeline group of its own, the ranks at TP rank t of every stage: TP rank t of stage s sends its hidden
states and residuals to TP rank t of stage s + 1 (after the row-parallel all-reduce every TP rank of a stage
holds them whole), and the last stage's TP rank 0, which holds the gathered logits, sends them to rank 0 over
the pipeline group of TP rank 0. Torch's send / recv carry them: gloo on CPU, NCCL on GPU.

Every transfer is a header and a payload: the header (int64: kind, step id, rows, columns) lets the receiver
check that the payload belongs to the step it runs, which is what lets later steps overlap (several steps in
flight, one per stage) without a barrier. A rank that dies closes its connections, so a peer waiting on it
raises at once (gloo: "Connection closed by peer") instead of waiting out the group's timeout.

Activations go stage to stage with blocking sends: gloo hands a payload over once the receiver has posted its
receive, and a sender that waits leaves its core to gloo's I/O thread, so the payload moves at once (a rank that
went on computing instead delayed its own transfers by milliseconds on a machine with a core per rank). The
logits go back to rank 0 as isends that the last stage never waits for (it keeps them until they are done, at most
one per step in flight): with several steps in flight rank 0 may be sending step k + 1's activations while the
last stage has step k's logits for it, and two blocking sends would wait on each other. Since the last stage never
blocks on a send, every blocked sender is waiting for a stage that will post its receive once it has finished the
step it runs.
"""
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from nanovllm_tp.utils import trace

ACTIVATIONS, LOGITS = 1, 2


@dataclass(slots=True)
class PPState:
    stage: int = 0
    size: int = 1
    tp_size: int = 1
    group: object = None            # this TP rank's pipeline group (None when size == 1)
    prev_rank: int | None = None    # global rank this stage receives activations from (None on the first)
    next_rank: int | None = None    # global rank it sends them to (None on the last)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def sampler_rank(self) -> int:
        """The global rank the last stage's logits go to."""
        return 0


_pp = PPState()


def current_pp() -> PPState:
    return PPState(_pp.stage, _pp.size, _pp.tp_size, _pp.group, _pp.prev_rank, _pp.next_rank)


def set_pp(state: PPState) -> None:
    _pp.stage, _pp.size, _pp.tp_size, _pp.group = state.stage, state.size, state.tp_size, state.group
    _pp.prev_rank, _pp.next_rank = state.prev_rank, state.next_rank


@contextlib.contextmanager
def pp_scope(state: PPState):
    """Run with `state` as this process's pipeline state, then restore the previous one (see tp_scope)."""
    saved = current_pp()
    set_pp(state)
    try:
        yield
    finally:
        set_pp(saved)


def pp_size() -> int:
    return _pp.size


def pp_stage() -> int:
    return _pp.stage


def is_first_stage() -> bool:
    return _pp.stage == 0


def is_last_stage() -> bool:
    return _pp.stage == _pp.size - 1


def build_groups(rank: int, tp: int, pp: int) -> tuple[int, object, PPState]:
    """Every rank makes every group, in one order (torch's rule for new_group): the stages' TP groups, then the
    TP ranks' pipeline groups. Returns this rank's TP rank, TP group (None at TP 1) and pipeline state."""
    stage, tp_rank = divmod(rank, tp)
    tp_group = pp_group = None
    if tp > 1:
        for s in range(pp):
            group = dist.new_group([s * tp + t for t in range(tp)])
            if s == stage:
                tp_group = group
    for t in range(tp):
        group = dist.new_group([s * tp + t for s in range(pp)])
        if t == tp_rank:
            pp_group = group
    state = PPState(stage, pp, tp, pp_group, None if stage == 0 else rank - tp,
                    None if stage == pp - 1 else rank + tp)
    return tp_rank, tp_group, state


_sending: list = []     # logits on their way: (isend works, the tensors they read), oldest first


def _start_send(tensors: list[torch.Tensor], dst: int) -> None:
    """Start sending `tensors` to global rank `dst` in order, without waiting (transfers that have completed are
    dropped first; one still on its way raises here if it failed, e.g. rank 0 died)."""
    while _sending and all(work.is_completed() for work in _sending[0][0]):
        for work in _sending.pop(0)[0]:
            work.wait()         # returns at once; raises what the transfer met
    _sending.append(([dist.isend(t, dst=dst, group=_pp.group) for t in tensors], tensors))


def forget_sends() -> None:
    """Drop the logits still on their way without waiting (the engine is closing; rank 0 may be gone)."""
    _sending.clear()


def _header(kind: int, step_id: int, rows: int, cols: int, device) -> torch.Tensor:
    return torch.tensor([kind, step_id, rows, cols], dtype=torch.int64, device=device)


def _recv_header(kind: int, step_id: int, src: int, device) -> tuple[int, int]:
    header = torch.empty(4, dtype=torch.int64, device=device)
    dist.recv(header, src=src, group=_pp.group)
    got_kind, got_step, rows, cols = header.tolist()
    if got_kind != kind or got_step != step_id:
        raise RuntimeError(f"pipeline: rank {src} sent {'logits' if got_kind == LOGITS else 'activations'} of step "
                           f"{got_step} where this rank waited for {'logits' if kind == LOGITS else 'activations'} "
                           f"of step {step_id}")
    return rows, cols


def send_activations(step_id: int, hidden: torch.Tensor, residual: torch.Tensor) -> None:
    """This stage's output for `step_id` to the next stage: hidden states and residuals, [tokens, hidden] each."""
    payload = torch.stack([hidden, residual])
    with trace.span("pp_send"):
        dist.send(_header(ACTIVATIONS, step_id, hidden.shape[0], hidden.shape[1], hidden.device),
                  dst=_pp.next_rank, group=_pp.group)
        dist.send(payload, dst=_pp.next_rank, group=_pp.group)


def recv_activations(step_id: int, tokens: int, hidden_size: int, dtype: torch.dtype,
                     device) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous stage's (hidden, residual) for `step_id`, whose plan says `tokens` tokens."""
    with trace.span("pp_recv"):
        rows, cols = _recv_header(ACTIVATIONS, step_id, _pp.prev_rank, device)
        if (rows, cols) != (tokens, hidden_size):
            raise RuntimeError(f"pipeline: step {step_id}'s activations from rank {_pp.prev_rank} are {rows} x "
                               f"{cols}; its plan has {tokens} tokens of {hidden_size}")
        payload = torch.empty(2, rows, cols, dtype=dtype, device=device)
        dist.recv(payload, src=_pp.prev_rank, group=_pp.group)
    return payload[0], payload[1]


def send_logits(step_id: int, logits: torch.Tensor) -> None:
    """The last stage's TP rank 0: the step's gathered logits [rows, vocab] to rank 0's sampler."""
    logits = logits.contiguous()
    with trace.span("pp_send_logits"):
        _start_send([_header(LOGITS, step_id, logits.shape[0], logits.shape[1], logits.device), logits],
                    _pp.sampler_rank)


def recv_logits(step_id: int, last_stage_rank: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Rank 0: the logits of `step_id` from the last stage's TP rank 0 (global rank `last_stage_rank`)."""
    with trace.span("pp_recv_logits"):
        rows, cols = _recv_header(LOGITS, step_id, last_stage_rank, device)
        logits = torch.empty(rows, cols, dtype=dtype, device=device)
        dist.recv(logits, src=last_stage_rank, group=_pp.group)
    return logits


def last_stage_leader() -> int:
    """The global rank of the last stage's TP rank 0, which sends the logits."""
    return (_pp.size - 1) * _pp.tp_size
