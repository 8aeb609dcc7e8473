"""Single-writer / multi-reader ring of fixed-size slots in POSIX shared memory.

This module only moves bytes; waiting, liveness and errors live in ``channel.py``.

Layout of the ring segment (all integers little-endian u64)::

    [0, 4096)              header: magic, num_slots, slot_bytes, num_readers,
                           slot_stride, closed, heartbeat, reason_len, reason
    slot i at 4096 + i * slot_stride:
        +0   seq       (1-based message number; written LAST by the writer)
        +8   length    (payload length in bytes)
        +16  kind      (0 = inline payload, 1 = overflow: payload holds a segment name)
        +24  name_len  (overflow only: length of the segment name)
        +32  flags     (one byte per reader, set to 1 once that reader has the message)
        +P   payload   (slot_bytes; P = 32 + num_readers rounded up to 64)

Sequence number, length and flags share one cache line (for up to 32 readers), so a publish
costs one ownership transfer for the slot header besides the payload lines.

Message ``seq`` lives in slot ``(seq - 1) % num_slots``.  The writer may reuse a slot only
once every reader flag of its previous message is set; it clears the flags, writes the
payload and length, issues a fence and only then stores ``seq``.  A reader waits for the
exact ``seq`` it expects, so it never observes a half-written payload.

Payloads larger than ``slot_bytes`` go to a one-off segment (name ``<prefix>_o<seq>``)
whose name is stored in the slot; the writer unlinks it as soon as every reader flag is
set (checked on each publish) and, at the latest, when the slot is reused or on close.

Readers attach with ``os.open`` + ``mmap`` on ``/dev/shm`` and therefore never touch
Python's resource_tracker (which would otherwise unlink or warn about segments it does
not own).  The writer's segments are kept out of the tracker too (``create_segment``): the
engine removes them itself, the writer on close or at exit, a reader once it finds the writer
dead; a tracker that owned them would race that cleanup and warn about "leaked" segments.
"""
from __future__ import annotations

import mmap
import os
import struct
import threading
from multiprocessing import resource_tracker, shared_memory

SHM_DIR = "/dev/shm"
HEADER_BYTES = 4096
FLAGS_AT = 32
MAX_REASON = 3072
_MAGIC = 0x316E_6972_7076_746E  # "ntvprin1"
_U64 = struct.Struct("<Q")
_LEN_KIND = struct.Struct("<QQ")
_HDR = struct.Struct("<8Q")  # magic, slots, slot_bytes, readers, stride, closed, hb, reason_len
_OFF_CLOSED, _OFF_HB, _OFF_REASON_LEN, _OFF_REASON = 40, 48, 56, 64
KIND_INLINE, KIND_OVERFLOW = 0, 1
_fence_lock = threading.Lock()


def fence() -> None:
    """Full memory barrier between plain shared-memory stores/loads (needed on ARM;
    uncontended lock acquire+release implies one on the platforms CPython supports)."""
    with _fence_lock:
        pass


def attach(name: str) -> mmap.mmap:
    """Map an existing segment read-write without Python's resource_tracker (which would otherwise unlink
    or warn about a segment this process did not create)."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise PermissionError(f"shared-memory segment {name!r} is not private to this user")
        return mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)


def create_segment(name: str, size: int) -> shared_memory.SharedMemory:
    """A new segment that Python's resource_tracker does not own: remove it with ``unlink_segment``."""
    seg = shared_memory.SharedMemory(name=name, create=True, size=size)
    resource_tracker.unregister(seg._name, "shared_memory")
    return seg


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def _round_up(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def _payload_at(num_readers: int) -> int:
    return _round_up(FLAGS_AT + num_readers)


def unlink_by_prefix(prefix: str) -> list[str]:
    """Unlink every segment in /dev/shm whose name starts with ``prefix`` (crash cleanup)."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass
    return removed


class ShmRingWriter:
    def __init__(self, prefix: str, num_slots: int, slot_bytes: int, num_readers: int):
        if num_slots < 1 or slot_bytes < 256 or not 1 <= num_readers <= 4096:
            raise ValueError("need num_slots >= 1, slot_bytes >= 256, 1..4096 readers")
        self.prefix = prefix
        self.num_slots, self.slot_bytes, self.num_readers = num_slots, slot_bytes, num_readers
        self._flags_len = num_readers
        self.stride = _round_up(_payload_at(num_readers) + slot_bytes)
        size = HEADER_BYTES + num_slots * self.stride
        self._shm = create_segment(f"{prefix}_r", size)
        self.name = self._shm.name
        self._buf = self._shm.buf
        _HDR.pack_into(self._buf, 0, _MAGIC, num_slots, slot_bytes, num_readers, self.stride, 0, 0, 0)
        self._slot_off = [HEADER_BYTES + i * self.stride for i in range(num_slots)]
        self._all_read = b"\x01" * num_readers
        self._none_read = bytes(num_readers)
        self._flags_fmt = struct.Struct(f"{num_readers}s")
        self._payload_delta = _payload_at(num_readers)
        self._overflow: dict[int, shared_memory.SharedMemory] = {}  # seq -> segment
        self._closed = False

    # -- slot state -------------------------------------------------------------
    def _flags(self, off: int) -> bytes:
        return self._flags_fmt.unpack_from(self._buf, off + FLAGS_AT)[0]

    def slot_free(self, seq: int) -> bool:
        """True if message ``seq`` may be written (the slot's previous message was read by all)."""
        return seq <= self.num_slots or self._flags(self._slot_off[(seq - 1) % self.num_slots]) == self._all_read

    def laggards(self, seq: int) -> list[int]:
        """Reader indices that have not yet read the message occupying ``seq``'s slot."""
        if seq <= self.num_slots:
            return []
        return [i for i, b in enumerate(self._flags(self._slot_off[(seq - 1) % self.num_slots])) if b != 1]

    def write(self, seq: int, payload) -> None:
        """Write message ``seq``; the caller must have checked ``slot_free(seq)``."""
        buf = self._buf
        off = self._slot_off[(seq - 1) % self.num_slots]
        fence()  # flag loads above happen-before our overwrite below
        old = self._overflow.pop(seq - self.num_slots, None)
        if old is not None:
            self._drop(old)
        n = len(payload)
        p = off + self._payload_delta
        if n <= self.slot_bytes:
            buf[p:p + n] = payload
            kind = KIND_INLINE
        else:
            seg = create_segment(f"{self.prefix}_o{seq}", n)
            seg.buf[:n] = payload
            seg.close()  # the mapping is not needed any more; the name stays until unlink
            self._overflow[seq] = seg
            name = seg.name.encode()
            buf[p:p + len(name)] = name
            _U64.pack_into(buf, off + 24, len(name))
            kind = KIND_OVERFLOW
        # header line last: length/kind, cleared flags, then (after a fence) the sequence number
        _LEN_KIND.pack_into(buf, off + 8, n, kind)
        f = off + FLAGS_AT
        buf[f:f + self._flags_len] = self._none_read
        fence()  # payload, length and cleared flags are visible before seq
        _U64.pack_into(buf, off, seq)

    def collect_overflow(self) -> None:
        """Unlink overflow segments that every reader has already copied."""
        if not self._overflow:
            return
        for seq in list(self._overflow):
            off = self._slot_off[(seq - 1) % self.num_slots]
            if _U64.unpack_from(self._buf, off)[0] == seq and self._flags(off) == self._all_read:
                self._drop(self._overflow.pop(seq))

    @staticmethod
    def _drop(seg: shared_memory.SharedMemory) -> None:
        unlink_segment(seg.name)

    # -- control ----------------------------------------------------------------
    def set_closed(self, reason: str) -> None:
        data = reason.encode("utf-8", "replace")[:MAX_REASON]
        self._buf[_OFF_REASON:_OFF_REASON + len(data)] = data
        _U64.pack_into(self._buf, _OFF_REASON_LEN, len(data))
        fence()
        _U64.pack_into(self._buf, _OFF_CLOSED, 1)

    def beat(self) -> None:
        """Advance the heartbeat counter (called periodically by the writer's monitor thread)."""
        if not self._closed:
            _U64.pack_into(self._buf, _OFF_HB, _U64.unpack_from(self._buf, _OFF_HB)[0] + 1)

    def close(self) -> None:
        """Unmap and unlink the ring and every outstanding overflow segment. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for seg in self._overflow.values():
            self._drop(seg)
        self._overflow.clear()
        self._buf = None
        try:
            self._shm.close()
        except BufferError:  # a stray export; unlinking below still frees the name
            pass
        self._drop(self._shm)


class ShmRingReader:
    def __init__(self, name: str, index: int):
        self._mm = attach(name)
        self._buf = memoryview(self._mm)
        magic, slots, slot_bytes, readers, stride, _, _, _ = _HDR.unpack_from(self._buf, 0)
        if magic != _MAGIC:
            self.close()
            raise ValueError(f"shared-memory segment {name!r} is not a plan ring")
        if not 0 <= index < readers:
            self.close()
            raise ValueError(f"reader index {index} out of range for {readers} readers")
        self.name, self.num_slots, self.index = name, slots, index
        self._slot_off = [HEADER_BYTES + i * stride for i in range(slots)]
        self._flag_delta = FLAGS_AT + index
        self._payload_delta = _payload_at(readers)
        self._next = 1

    def poll(self) -> bytes | None:
        """Return the next message if it has been published, else None. Never blocks.

        Raises FileNotFoundError if an overflow segment vanished (writer gone)."""
        buf = self._buf
        seq = self._next
        off = self._slot_off[(seq - 1) % self.num_slots]
        if _U64.unpack_from(buf, off)[0] != seq:
            return None
        fence()
        n, kind = _LEN_KIND.unpack_from(buf, off + 8)
        p = off + self._payload_delta
        if kind == KIND_INLINE:
            data = bytes(buf[p:p + n])
        else:
            name_len = _U64.unpack_from(buf, off + 24)[0]
            name = bytes(buf[p:p + name_len]).decode()
            fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
            try:
                data = os.pread(fd, n, 0)
                while len(data) < n:  # pread may return short reads for huge sizes
                    data += os.pread(fd, n - len(data), len(data))
            finally:
                os.close(fd)
        fence()  # our payload loads complete before the writer may see the flag
        buf[off + self._flag_delta] = 1
        self._next = seq + 1
        return data

    def closed_reason(self) -> str | None:
        """The shutdown reason once the writer closed the channel, else None."""
        if _U64.unpack_from(self._buf, _OFF_CLOSED)[0] != 1:
            return None
        fence()
        n = _U64.unpack_from(self._buf, _OFF_REASON_LEN)[0]
        return bytes(self._buf[_OFF_REASON:_OFF_REASON + n]).decode("utf-8", "replace")

    def heartbeat(self) -> int:
        return _U64.unpack_from(self._buf, _OFF_HB)[0]

    def close(self) -> None:
        if self._buf is not None:
            self._buf.release()
            self._buf = None
            self._mm.close()
