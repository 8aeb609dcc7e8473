"""A GGUF file's header, read without the gguf package: its metadata (string arrays such as the vocabulary are
stepped over, not decoded, so a rank pays milliseconds for it) and its tensor table (names, shapes in torch order,
types, byte offsets). Also: which .gguf file a model path names, and the gguf package for what needs it."""
import functools
import glob
import os
import struct
from dataclasses import dataclass

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def find_gguf(model: str) -> str | None:
    """The .gguf file `model` names: the path itself, or the one .gguf in a directory without config.json."""
    if os.path.isfile(model) and model.endswith(".gguf"):
        return os.path.abspath(model)
    if not os.path.isdir(model) or os.path.isfile(os.path.join(model, "config.json")):
        return None
    found = sorted(glob.glob(os.path.join(model, "*.gguf")))
    if len(found) > 1:
        raise ValueError(f"{model!r} holds several .gguf files ({', '.join(map(os.path.basename, found))}); "
                         "pass the one to load")
    return os.path.abspath(found[0]) if found else None


def require_gguf():
    try:
        import gguf
    except ImportError:
        raise ValueError("reading a .gguf file needs the gguf package: pip install gguf") from None
    return gguf


@dataclass(slots=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]     # torch order (GGUF lists the innermost dimension first)
    ggml_type: int
    start: int                 # byte offset in the file


@dataclass(slots=True)
class GGUFHeader:
    path: str
    metadata: dict             # string arrays (vocabulary, merges) are kept as their length only
    tensors: list[TensorEntry]

    @property
    def arch(self) -> str:
        return self.metadata["general.architecture"]


class _Cursor:
    def __init__(self, blob):
        self.blob, self.pos = blob, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self.blob, self.pos)
        self.pos += struct.calcsize(fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        self.pos += n
        return bytes(self.blob[self.pos - n:self.pos]).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF metadata value type {kind}")
        item_kind, count = self.unpack("<I"), self.unpack("<Q")
        if item_kind in _SCALARS:
            fmt = _SCALARS[item_kind]
            values = list(struct.unpack_from(f"<{count}{fmt[1]}", self.blob, self.pos))
            self.pos += count * struct.calcsize(fmt)
            return values
        for _ in range(count):      # strings or nested arrays: step over them, keep the count
            self.value(item_kind)
        return count


@functools.lru_cache(maxsize=4)
def read_header(path: str) -> GGUFHeader:
    blob = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(blob)
    if bytes(blob[:4]) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
    cur.pos = 4
    version, n_tensors, n_kv = cur.unpack("<IQQ")
    if version not in (2, 3):
        raise ValueError(f"{path} is GGUF version {version}; versions 2 and 3 are read")
    metadata = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("<I"))
    entries = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = cur.unpack(f"<{cur.unpack('<I')}Q")
        dims = (dims,) if isinstance(dims, int) else dims
        ggml_type, offset = cur.unpack("<IQ")
        entries.append((name, tuple(reversed(dims)), ggml_type, offset))
    align = metadata.get("general.alignment", 32)
    data_start = -(-cur.pos // align) * align
    tensors = [TensorEntry(n, s, t, data_start + o) for n, s, t, o in entries]
    return GGUFHeader(path, metadata, tensors)
