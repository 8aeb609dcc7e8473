"""A CPU engine's KV pool in shared memory, which another engine on the same host maps to copy a request's blocks
from pool to pool (engine/kv_transfer.py's hand-off by reference: no bytes through Python objects or sockets).

The pool is one anonymous memory file (memfd: no name in /dev/shm, so nothing outlives the process on any exit
path, and no tmpfs size limit applies). Another process of the same user opens it as /proc/<pid>/fd/<fd>. It holds

    [0, HEADER)  b"NVTPKVP1", a 4-byte little-endian length, then a msgpack map: the pool's random token, its shape
                 [layers, blocks, block_size, kv_heads, head_dim], kv_dtype, and each array's [offset, bytes]
    stamps       one uint64 per block: the block's version (scheduler/block_manager.py bumps it each time the block
                 is taken for other tokens)
    k, v         [layers, blocks, block_size, kv_heads, head_dim] each, in the cache's storage dtype
    k_scale, v_scale   an 8-bit cache's fp32 scales [layers, blocks, block_size, kv_heads]

A reader copies the blocks it was told of, then reads their stamps: a stamp that moved since the export means the
exporter took the block for other tokens while it was being read, and the copy is thrown away (the request then
computes its tokens again). The token, in the payload and in the header, makes sure the file opened is that pool.
"""
import mmap
import os
import secrets
import stat
import struct
import warnings

import msgpack
import numpy as np
import torch

from nanovllm_tp.config.platform import DTYPES
from nanovllm_tp.layers.attention.kv_quant import KV_CACHE_DTYPES, SCALE_DTYPE

MAGIC = b"NVTPKVP1"
HEADER = 4096
_ALIGN = 4096
_MADV_POPULATE_READ = 22       # linux/mman.h; Python 3.11's mmap module has no name for it
_POPULATE_CHUNK = 4 << 20      # bytes populate() maps per call (it holds the GIL, half a ms each)
# a cache's storage by the name kv_cache_format() gives it: the model's dtype, or an 8-bit format ("fp8" is "fp8_e4m3")
_STORAGE = {**DTYPES, **{name: dtype for name, dtype in KV_CACHE_DTYPES.items() if dtype is not None and name != "fp8"}}


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _array_bytes(shape: list[int], kv_dtype: str) -> dict[str, int]:
    """Each array's bytes in a pool of `shape` [layers, blocks, block_size, kv_heads, head_dim] and storage
    `kv_dtype` (the scales only where the cache has them)."""
    values = int(np.prod(shape)) * _STORAGE[kv_dtype].itemsize
    scales = int(np.prod(shape[:-1])) * SCALE_DTYPE.itemsize
    return {"stamps": shape[1] * 8, "k": values, "v": values, "k_scale": scales, "v_scale": scales}


class SharedKVPool:
    """The pool's arrays over one memory file: `create` makes this engine's (zeroed), `open_peer` maps another
    engine's read-only. `parts`: part name -> tensor (k, v, and the scales of an 8-bit cache); `stamps`: the
    blocks' versions as a uint64 memoryview."""

    def __init__(self, fd: int, buf: mmap.mmap, header: dict, owner: bool, pid: int):
        self.fd, self.buf, self.header, self.owner, self.pid = fd, buf, header, owner, pid
        self.token: str = header["token"]
        self.num_blocks: int = header["shape"][1]
        with warnings.catch_warnings():      # a peer's mapping is read-only; it is only read from
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.parts = {name: self._tensor(name) for name in header["arrays"] if name != "stamps"}
        off, size = header["arrays"]["stamps"]
        self.stamps = memoryview(buf)[off:off + size].cast("Q")

    def _tensor(self, name: str) -> torch.Tensor:
        off, size = self.header["arrays"][name]
        shape = self.header["shape"] if name in ("k", "v") else self.header["shape"][:-1]
        dtype = _STORAGE[self.header["kv_dtype"]] if name in ("k", "v") else SCALE_DTYPE
        return torch.frombuffer(self.buf, dtype=torch.uint8, count=size, offset=off).view(dtype).view(*shape)

    @classmethod
    def create(cls, shape: tuple[int, ...], kv_dtype: str, scaled: bool) -> "SharedKVPool":
        """This engine's pool of `shape` [layers, blocks, block_size, kv_heads, head_dim] in storage `kv_dtype`
        (`scaled`: with fp32 scales), zeroed. OSError when the memory file cannot be made or filled."""
        arrays, off = {}, HEADER
        for name, size in _array_bytes(list(shape), kv_dtype).items():
            if scaled or name not in ("k_scale", "v_scale"):
                arrays[name] = [off, size]
                off = _align(off + size)
        header = {"token": secrets.token_hex(16), "shape": list(shape), "kv_dtype": kv_dtype, "arrays": arrays}
        fd = os.memfd_create("nanovllm-tp-kv-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, off)
            os.posix_fallocate(fd, 0, off)     # ENOSPC here, not SIGBUS at a page's first write
            buf = mmap.mmap(fd, off, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)    # no page fault at first use
        except BaseException:
            os.close(fd)
            raise
        meta = msgpack.packb(header)
        buf[:len(MAGIC) + 4 + len(meta)] = MAGIC + struct.pack("<I", len(meta)) + meta
        return cls(fd, buf, header, owner=True, pid=os.getpid())

    def ref(self) -> dict:
        """What a payload carries for another engine to open this pool."""
        return {"pid": self.pid, "fd": self.fd, "token": self.token}

    @classmethod
    def open_peer(cls, ref: dict) -> "SharedKVPool":
        """Another engine's pool on this host from its `ref` (pid, fd, token), mapped read-only. ValueError when it
        cannot be opened (its engine is gone) or is not that pool."""
        pid, fd, token = ref["pid"], ref["fd"], ref["token"]
        try:       # O_NONBLOCK: an fd that is a FIFO must not hang the engine waiting for a writer
            peer = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise ValueError(f"the KV pool of process {pid} cannot be opened ({exc.strerror})") from None
        try:
            st = os.fstat(peer)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode) or size < HEADER:
                raise ValueError(f"process {pid}'s fd {fd} is not a KV pool")
            # not populated here (a large pool would stall the caller for seconds): populate() does it, aside
            buf = mmap.mmap(peer, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as exc:
            raise ValueError(f"the KV pool of process {pid} cannot be mapped ({exc.strerror})") from None
        finally:
            os.close(peer)
        header = _read_header(buf, size)
        if header is None or header.get("token") != token:
            buf.close()           # nothing views it yet
            raise ValueError(f"process {pid}'s fd {fd} is not the KV pool the payload names")
        return cls(-1, buf, header, owner=False, pid=pid)

    def populate(self) -> None:
        """Map every page of the pool ahead of the copies (MADV_POPULATE_READ, Linux 5.14), a chunk at a time, so
        that a copy finds its pages mapped instead of faulting them in one by one: run in a thread of its own
        after open_peer (a GiB takes about 0.1 s). Stops at close(); on an older kernel the copies fault."""
        size = len(self.buf)
        for start in range(0, size, _POPULATE_CHUNK):
            buf = self.buf
            if buf is None:
                return
            try:
                buf.madvise(_MADV_POPULATE_READ, start, min(_POPULATE_CHUNK, size - start))
            except (OSError, ValueError):     # an older kernel; or closed meanwhile
                return

    def close(self) -> None:
        """Let go of the pool: the mapping goes with the last tensor that views it (each holds the mmap object;
        closing it under them would leave them pointing at nothing), and the engine's own memory file is closed
        (a peer that opens its fd number afterwards finds another file, or none, and no token)."""
        self.parts, self.stamps, self.buf = {}, None, None
        if self.owner and self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _read_header(buf: mmap.mmap, size: int) -> dict | None:
    """The header map of a pool file, every array inside the file, or None."""
    if bytes(buf[:len(MAGIC)]) != MAGIC:
        return None
    length, = struct.unpack_from("<I", buf, len(MAGIC))
    if length > HEADER - len(MAGIC) - 4:
        return None
    try:
        header = msgpack.unpackb(bytes(buf[len(MAGIC) + 4:len(MAGIC) + 4 + length]))
    except Exception:
        return None
    if not isinstance(header, dict) or not isinstance(header.get("token"), str):
        return None
    shape, arrays = header.get("shape"), header.get("arrays")
    if not (isinstance(shape, list) and len(shape) == 5 and all(isinstance(n, int) and n > 0 for n in shape)
            and header.get("kv_dtype") in _STORAGE and isinstance(arrays, dict) and "stamps" in arrays):
        return None
    for name, span in arrays.items():
        if name not in ("stamps", "k", "v", "k_scale", "v_scale") or not (
                isinstance(span, list) and len(span) == 2 and all(isinstance(n, int) and n >= 0 for n in span)
                and span[0] + span[1] <= size):
            return None
    want = _array_bytes(shape, header["kv_dtype"])
    if any(span[1] != want[name] for name, span in arrays.items()):
        return None
    return header
