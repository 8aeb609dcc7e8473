"""Shared-memory sum all-reduce for tensor-parallel ranks on one node (CPU tensors).

gloo costs milliseconds per call over TCP loopback even for a few KB; here every rank copies its tensor
into its own slot of one segment, publishes a generation counter, waits for every peer's counter, and
sums all slots in rank order 0..N-1 in the tensor's dtype, so every rank holds bit-identical values.

Layout (u64 little-endian): header ``magic, world, slot_bytes``; one 64-byte line per rank at
``64 + 64 * rank``: ``gen, closed, pid, start_time, pid_namespace``; data from ``DATA_AT``: two slots
per rank (double buffer by generation parity). A rank writes slot ``gen % 2`` of call ``gen`` only after
every peer published ``gen - 1``, i.e. finished reading call ``gen - 2``'s slots, so one wait per call
suffices. The counter is stored after the data, behind a fence (see ``shm_ring.fence``).

Never hangs: while waiting it checks peers' ``closed`` flags, every 0.2 s their pid + start time (when
they share our pid namespace), and gives up after ``timeout_s``, raising RuntimeError naming the rank.
Rank 0 creates the segment (``nvtp_<pid>_<token>_ar``); others attach with shm_ring.attach, bypassing
Python's resource_tracker; rank 0 unlinks it on close, a rank that finds rank 0 dead unlinks it too.
"""
from __future__ import annotations

import os
import secrets
import struct
import time

import torch

from .channel_common import _CHECK_S, _MAX_NAP_S, proc_start_time
from .shm_ring import SHM_DIR, attach, create_segment, fence

_MAGIC = 0x3172_6176_746E  # "ntvar1"
_U64 = struct.Struct("<Q")
_HDR = struct.Struct("<3Q")
_LINE = struct.Struct("<5Q")
DATA_AT = 4096
DEFAULT_SLOT_BYTES = 1 << 20
_DTYPES = {torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64}
_yield = getattr(os, "sched_yield", lambda: None)


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


class ShmAllReduce:
    def __init__(self, name: str, rank: int, shm=None, timeout_s: float = 60.0):
        self.name, self.rank, self._shm, self.owner = name, rank, shm, shm is not None
        self.timeout_s, self._gen, self._broken, self._mm = timeout_s, 0, None, None
        if shm is not None:
            self._buf = shm.buf
        else:
            self._mm = attach(name)
            self._buf = memoryview(self._mm)
        magic, self.world, self.slot_bytes = _HDR.unpack_from(self._buf, 0)
        if magic != _MAGIC or not 0 <= rank < self.world:
            self.close()
            raise ValueError(f"{name!r} is not a shm all-reduce segment for rank {rank}")
        self._line = [64 + 64 * r for r in range(self.world)]
        self._peers = [r for r in range(self.world) if r != rank]
        self._data = torch.frombuffer(self._buf, dtype=torch.uint8)
        self._views: dict = {}
        _LINE.pack_into(self._buf, self._line[rank], 0, 0, os.getpid(), proc_start_time(os.getpid()) or 0,
                        _pid_ns())

    @classmethod
    def create(cls, world: int, slot_bytes: int = DEFAULT_SLOT_BYTES, timeout_s: float = 60.0) -> ShmAllReduce:
        slot_bytes = (slot_bytes + 4095) // 4096 * 4096
        name = f"nvtp_{os.getpid()}_{secrets.token_hex(4)}_ar"
        shm = create_segment(name, DATA_AT + 2 * world * slot_bytes)
        _HDR.pack_into(shm.buf, 0, _MAGIC, world, slot_bytes)
        return cls(shm.name, 0, shm, timeout_s)

    @classmethod
    def attach(cls, name: str, rank: int, timeout_s: float = 60.0) -> ShmAllReduce:
        return cls(name, rank, None, timeout_s)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.dtype in _DTYPES and x.is_contiguous()
                and x.numel() * x.element_size() <= self.slot_bytes)

    def _slots(self, dtype: torch.dtype, numel: int) -> list:
        """Per parity, every rank's slot viewed as ``numel`` elements of ``dtype`` (cached)."""
        views = self._views.get((dtype, numel))
        if views is None:
            if len(self._views) > 256:
                self._views.clear()
            n, sb = numel * torch.empty((), dtype=dtype).element_size(), self.slot_bytes
            views = [[self._data[DATA_AT + (2 * r + p) * sb:][:n].view(dtype) for r in range(self.world)]
                     for p in (0, 1)]
            self._views[(dtype, numel)] = views
        return views

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over every rank, in place; the caller checked ``fits(x)``."""
        if self._broken:
            raise RuntimeError(self._broken)
        gen = self._gen + 1
        slots = self._slots(x.dtype, x.numel())[gen & 1]
        flat = x.view(-1)
        slots[self.rank].copy_(flat)
        fence()                                 # data stores before the counter store
        _U64.pack_into(self._buf, self._line[self.rank], gen)
        self._gen = gen
        buf = self._buf
        for r in self._peers:
            if _U64.unpack_from(buf, self._line[r])[0] < gen:
                self._wait(r, gen)
        fence()                                 # counter loads before the data loads
        torch.add(slots[0], slots[1], out=flat)
        for s in slots[2:]:
            flat.add_(s)
        return x

    def _wait(self, rank: int, gen: int) -> None:
        buf, off = self._buf, self._line[rank]
        t0 = time.perf_counter()
        check_due, nap, spins = t0 + _CHECK_S, 20e-6, 0
        while _U64.unpack_from(buf, off)[0] < gen:
            spins += 1
            if spins & 15:
                _yield()
                continue
            now = time.perf_counter()
            if _U64.unpack_from(buf, off + 8)[0]:
                self._fail(rank, "closed its end of the shm all-reduce (it failed or shut down)")
            if now >= check_due:
                check_due = now + _CHECK_S
                self._check_alive()
                if now - t0 > self.timeout_s:
                    self._fail(rank, f"did not reach all-reduce {gen} within {self.timeout_s:.0f} s")
            if now - t0 < 0.002:
                _yield()
            else:
                time.sleep(nap)
                nap = min(nap * 2, _MAX_NAP_S)

    def _check_alive(self) -> None:
        my_ns = _pid_ns()
        for r in self._peers:
            _, closed, pid, start, ns = _LINE.unpack_from(self._buf, self._line[r])
            if closed:
                self._fail(r, "closed its end of the shm all-reduce (it failed or shut down)")
            if pid and ns and ns == my_ns and proc_start_time(pid) != start:
                self._fail(r, f"process {pid} died")

    def _fail(self, rank: int, why: str) -> None:
        self._broken = f"shm all-reduce: rank {rank} {why}"
        if rank == 0 and not self.owner:
            self.unlink()
        raise RuntimeError(self._broken)

    def _rank0_dead(self) -> bool:
        _, _, pid, start, ns = _LINE.unpack_from(self._buf, self._line[0])
        return bool(pid and ns == _pid_ns() and proc_start_time(pid) != start)

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except OSError:
            pass

    def close(self) -> None:
        """Mark this rank closed (waiting peers raise), unmap; rank 0, or anyone once rank 0 is dead,
        unlinks the name. Idempotent."""
        if self._buf is None:
            return
        if len(self._buf) >= DATA_AT and getattr(self, "_line", None):
            _U64.pack_into(self._buf, self._line[self.rank] + 8, 1)
            if not self.owner and self._rank0_dead():
                self.unlink()
        self._views, self._data = {}, None      # no tensor may outlive the mapping
        self._buf.release()
        self._buf = None
        if self._shm is not None:
            self._shm.close()
            self.unlink()
        elif self._mm is not None:
            self._mm.close()


_installed: ShmAllReduce | None = None


def installed() -> ShmAllReduce | None:
    return _installed


def setup(info, all_local: bool, device: torch.device, enabled: bool = True,
          key: str = "nvtp_ar/name") -> ShmAllReduce | None:
    """Every rank calls this with the same ``all_local`` and ``enabled`` (the engine's shm_allreduce knob): rank 0
    creates the segment and shares its name through ``info.store``, the others attach; the result is what
    ``parallel_state.all_reduce`` uses."""
    global _installed
    if info.world_size < 2 or not all_local or device.type != "cpu" or not enabled:
        return None
    if info.rank == 0:
        ar = ShmAllReduce.create(info.world_size)
        info.store.set(key, ar.name)
    else:
        ar = ShmAllReduce.attach(info.store.get(key).decode(), info.rank)
    _installed = ar
    return ar


def teardown() -> None:
    """Uninstall and close this process's shm all-reduce (if any). Idempotent."""
    global _installed
    ar, _installed = _installed, None
    if ar is not None:
        ar.close()



def setup_stage(info, all_local: bool, device: torch.device, enabled: bool, tp, pp) -> ShmAllReduce | None:
    """`setup` for this rank's TP group (`tp`: its TPState, `pp`: its PPState): every rank of the engine, or under
    pipeline parallelism its stage's TP ranks only (a segment per stage, made by the stage's TP rank 0: each stage
    all-reduces apart)."""
    if pp.size == 1:
        return setup(info, all_local, device, enabled)
    from types import SimpleNamespace
    stage = SimpleNamespace(rank=tp.rank, world_size=tp.size, store=info.store)
    return setup(stage, all_local, device, enabled, key=f"nvtp_ar/name/stage{pp.stage}")
