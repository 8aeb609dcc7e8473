"""The bytes a request moves in between engines (engine/kv_transfer.py): its state and its KV, a msgpack map with
explicit fields, nothing pickled, the KV as raw bytes of the cache's own dtype.

    {"format": FORMAT, "version": VERSION, "byteorder": "little",
     "layout": {"architecture", "vocab_size", "num_layers", "tp_size", "num_kv_heads" (of one TP rank), "head_dim",
                "block_size", "kv_dtype"},
     "request_id", "prompt_token_ids", "priority",
     "lora": None, or the request's LoRA adapter [name, id, path] (its KV was computed with it),
     "draft_layout": None, or the layout of the exporter's draft model's cache (speculative_config draft_model),
                     whose KV travels beside the target's (its parts named "draft_k", "draft_v", ...),
     "params": the request's SamplingParams as the server's wire sends them (serving/wire.py), its seed the
               request's own (drawn by the first engine where the caller set none),
     "pool": None, or {"pid", "fd", "token"}: the exporter's shared KV pool (workers/kv_pool.py), which the
             completions' "blocks" are in,
     "completions": [{"index", "token_ids" (generated so far), "sent_chars" (characters of its text the caller
                      has seen), "num_cached_tokens" (tokens whose KV travels: 0, or all but the last token),
                      and where it travels, one of
                      "kv": {"k", "v"[, "k_scale", "v_scale"]}: bytes of [tp_size, layers, blocks, block_size,
                            kv_heads, head_dim] (scales without head_dim, fp32) over the completion's blocks (TP
                            rank i's KV heads i-th), and the draft's parts with "draft_" before their names, or
                      "blocks" and "versions": the completion's block ids in the exporter's pool and their versions
                            when it left (a hand-off on one host: the importer copies them from pool to pool)}]}

`KVPayload.decode` checks the shape of every field; `check_against` checks the payload against the importing
engine's own caches (`CacheSpec`: every layout field equal, the draft's too, each completion's token counts against
its block count, each part's byte count), so that nothing reaches the engine before the whole payload is known to
fit. A mismatch raises ValueError naming the field.
"""
import sys
from dataclasses import dataclass, fields

import msgpack

FORMAT = "nanovllm-tp kv transfer"
VERSION = 3
VALUE_PARTS = ("k", "v")
SCALE_PARTS = ("k_scale", "v_scale")
SCALE_BYTES = 4          # an 8-bit cache's fp32 scale per token and KV head
DRAFT = "draft_"         # before the name of each part of the draft model's cache


@dataclass(slots=True, frozen=True)
class KVLayout:
    """What an engine's KV blocks are: equal on both sides, or the payload is refused."""
    architecture: str
    vocab_size: int
    num_layers: int
    tp_size: int           # the engine's TP ranks, each holding num_kv_heads of the KV heads
    num_kv_heads: int      # of one TP rank
    head_dim: int
    block_size: int
    kv_dtype: str          # the cache's storage: "float32", "bfloat16", "int8", "fp8_e4m3", ...

    def to_wire(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_wire(cls, d, field: str = "layout") -> "KVLayout":
        if not isinstance(d, dict):
            raise ValueError(f"KV payload field {field} must be a map, got {type(d).__name__}")
        values = {}
        for f in fields(cls):
            v = d.get(f.name)
            if f.type is str and not isinstance(v, str):
                raise ValueError(f"KV payload field {field}.{f.name} must be a string, got {v!r}")
            if f.type is int and not _is_int(v, 1):
                raise ValueError(f"KV payload field {field}.{f.name} must be a positive integer, got {v!r}")
            values[f.name] = v
        return cls(**values)

    def part_bytes(self, name: str, num_blocks: int, value_bytes: int) -> int:
        """Bytes of `num_blocks` blocks of one part (values of `value_bytes` each, or fp32 scales)."""
        per_head = SCALE_BYTES if name in SCALE_PARTS else self.head_dim * value_bytes
        return self.tp_size * self.num_layers * num_blocks * self.block_size * self.num_kv_heads * per_head


@dataclass(slots=True, frozen=True)
class CacheSpec:
    """One cache an engine moves KV of: its layout, the bytes of one stored value, whether fp32 scales go with
    them, and the prefix of its parts' names ("" for the model's cache, DRAFT for a draft model's)."""
    layout: KVLayout
    value_bytes: int
    scaled: bool
    prefix: str = ""

    @property
    def parts(self) -> tuple[str, ...]:
        """Its parts' names in a payload (the cache's arrays after `prefix`)."""
        return tuple(self.prefix + n for n in VALUE_PARTS + (SCALE_PARTS if self.scaled else ()))

    def part_bytes(self, blocks: int) -> dict[str, int]:
        """{part name: its bytes} over `blocks` blocks."""
        return {name: self.layout.part_bytes(name[len(self.prefix):], blocks, self.value_bytes) for name in self.parts}


@dataclass(slots=True)
class CompletionKV:
    """One unfinished completion: its tokens so far, what its caller saw, and the KV of all but its last token."""
    index: int
    token_ids: list[int]
    sent_chars: int
    num_cached_tokens: int = 0          # 0: no KV travels (the importer computes it again)
    kv: dict[str, bytes] | None = None  # part name -> bytes (VALUE_PARTS, and SCALE_PARTS for an 8-bit cache)
    blocks: list[int] | None = None     # or its blocks in the exporter's shared pool (`pool`), and their versions
    versions: list[int] | None = None
    pool: dict | None = None            # the payload's "pool", where blocks are given

    @property
    def has_kv(self) -> bool:
        return self.kv is not None or self.blocks is not None

    def num_blocks(self, block_size: int) -> int:
        return -(-self.num_cached_tokens // block_size)

    def to_wire(self) -> dict:
        return {"index": self.index, "token_ids": self.token_ids, "sent_chars": self.sent_chars,
                "num_cached_tokens": self.num_cached_tokens, "kv": self.kv, "blocks": self.blocks,
                "versions": self.versions}

    def check(self, caches: list[CacheSpec], prompt_len: int, where: str) -> None:
        """Its KV fits these caches (the model's first, then a draft's) after a prompt of `prompt_len` tokens: the
        KV of all but its last token, each part's bytes those of its blocks."""
        if not self.has_kv:
            return
        layout = caches[0].layout
        total = prompt_len + len(self.token_ids)
        if self.num_cached_tokens != total - 1:
            raise ValueError(f"KV payload field {where}.num_cached_tokens is {self.num_cached_tokens}: a decoding "
                             f"completion of {total} tokens has the KV of {total - 1}")
        if self.blocks is not None:
            blocks = self.num_blocks(layout.block_size)
            if len(self.blocks) != blocks or len(self.versions) != blocks:
                raise ValueError(f"KV payload field {where}.blocks lists {len(self.blocks)} blocks and "
                                 f"{len(self.versions)} versions; {self.num_cached_tokens} tokens take {blocks}")
            return
        blocks = self.num_blocks(layout.block_size)
        parts = {name: size for cache in caches for name, size in cache.part_bytes(blocks).items()}
        if sorted(self.kv) != sorted(parts):
            raise ValueError(f"KV payload field {where}.kv holds {sorted(self.kv)}, this engine's cache "
                             f"({layout.kv_dtype}{', and a draft model' if len(caches) > 1 else ''}) is "
                             f"{sorted(parts)}")
        for name, want in parts.items():
            if len(self.kv[name]) != want:
                raise ValueError(f"KV payload field {where}.kv.{name} has {len(self.kv[name])} bytes; "
                                 f"{blocks} blocks of {self.num_cached_tokens} tokens take {want}")

    def cut(self, token_ids: list[int], sent_chars: int, prompt_len: int, caches: list[CacheSpec]) -> "CompletionKV":
        """This completion as it was when it had generated only `token_ids` (a prefix of its own; its caller had
        seen `sent_chars` characters): the KV of all but the last of those tokens, its blocks the leading ones of
        each part (a block's values past the cut are stale and are written again by the decode that reaches them).
        Without KV, or with no token to keep KV for, the cut carries none."""
        cached = prompt_len + len(token_ids) - 1
        out = CompletionKV(self.index, list(token_ids), sent_chars)
        if not self.has_kv or cached <= 0:
            return out
        out.num_cached_tokens = cached
        block_size = caches[0].layout.block_size
        old, new = self.num_blocks(block_size), out.num_blocks(block_size)
        if self.blocks is not None:
            out.blocks, out.versions, out.pool = self.blocks[:new], self.versions[:new], self.pool
            return out
        layers = {name: c.layout.tp_size * c.layout.num_layers for c in caches for name in c.parts}
        out.kv = {name: data if new == old else _leading_blocks(data, layers[name], old, new)
                  for name, data in self.kv.items()}
        return out

    @classmethod
    def from_wire(cls, i: int, d) -> "CompletionKV":
        where = f"completions[{i}]"
        if not isinstance(d, dict):
            raise ValueError(f"KV payload field {where} must be a map, got {type(d).__name__}")
        for name in ("index", "sent_chars", "num_cached_tokens"):
            if not _is_int(d.get(name), 0):
                raise ValueError(f"KV payload field {where}.{name} must be an integer >= 0, got {d.get(name)!r}")
        _token_list(f"{where}.token_ids", d.get("token_ids"), empty=True)
        kv, blocks, versions = d.get("kv"), d.get("blocks"), d.get("versions")
        if kv is not None and (not isinstance(kv, dict) or not all(
                isinstance(k, str) and isinstance(v, bytes) for k, v in kv.items())):
            raise ValueError(f"KV payload field {where}.kv must be None or a map of part names to bytes")
        for name, ids in (("blocks", blocks), ("versions", versions)):
            if ids is not None and not (isinstance(ids, list) and all(_is_int(i, 0) for i in ids)):
                raise ValueError(f"KV payload field {where}.{name} must be None or a list of integers >= 0")
        if (blocks is None) != (versions is None) or (kv is not None and blocks is not None):
            raise ValueError(f"KV payload field {where}: its KV travels as kv, or as blocks with their versions")
        if (kv is None and blocks is None) != (d["num_cached_tokens"] == 0):
            raise ValueError(f"KV payload field {where}.kv: KV travels exactly when num_cached_tokens > 0 (here "
                             f"{d['num_cached_tokens']}, and its KV is "
                             f"{'absent' if kv is None and blocks is None else 'present'})")
        return cls(d["index"], d["token_ids"], d["sent_chars"], d["num_cached_tokens"], kv, blocks, versions)


@dataclass(slots=True)
class KVPayload:
    layout: KVLayout
    request_id: str
    prompt_token_ids: list[int]
    params: dict                     # SamplingParams on the wire (serving/wire.py params_to_wire)
    priority: int
    completions: list[CompletionKV]
    pool: dict | None = None         # {"pid", "fd", "token"} where completions give their blocks in it
    lora: list | None = None         # [name, id, path]: the adapter the KV was computed with
    draft: KVLayout | None = None    # the exporter's draft model's cache, whose KV travels too

    def encode(self) -> memoryview:
        """The payload's msgpack bytes, as a read-only view of the one buffer they were packed into: sized for the
        KV up front, so that the KV's bytes are copied once (a plain packb grows its buffer, copying them again at
        each doubling, and copies the whole into a bytes object at the end)."""
        tokens = len(self.prompt_token_ids) + sum(len(c.token_ids) for c in self.completions)
        packer = msgpack.Packer(use_bin_type=True, autoreset=False,
                                buf_size=self.num_bytes + 9 * tokens + (1 << 16))
        packer.pack({"format": FORMAT, "version": VERSION, "byteorder": sys.byteorder,
                     "layout": self.layout.to_wire(), "request_id": self.request_id,
                     "prompt_token_ids": self.prompt_token_ids, "params": self.params,
                     "priority": self.priority, "pool": self.pool, "lora": self.lora,
                     "draft_layout": self.draft and self.draft.to_wire(),
                     "completions": [c.to_wire() for c in self.completions]})
        return packer.getbuffer()

    @property
    def num_bytes(self) -> int:
        """The KV's bytes (every part of every completion)."""
        return sum(len(b) for c in self.completions for b in (c.kv or {}).values())

    @classmethod
    def decode(cls, raw) -> "KVPayload":
        """The payload's fields, each of its expected type (ValueError naming the first that is not)."""
        if not isinstance(raw, (bytes, bytearray, memoryview)):
            raise ValueError(f"a KV payload is bytes, got {type(raw).__name__}")
        try:
            d = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception as exc:       # truncated, or not msgpack at all
            raise ValueError(f"KV payload is not a whole msgpack map ({type(exc).__name__}: {exc})") from None
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError(f"KV payload field format must be {FORMAT!r}: this is not a KV transfer")
        if d.get("version") != VERSION:
            raise ValueError(f"KV payload field version: {d.get('version')!r}, this engine reads {VERSION}")
        if d.get("byteorder") != sys.byteorder:
            raise ValueError(f"KV payload field byteorder: {d.get('byteorder')!r}, this host is {sys.byteorder}")
        layout = KVLayout.from_wire(d.get("layout"))
        if not isinstance(d.get("request_id"), str):
            raise ValueError(f"KV payload field request_id must be a string, got {d.get('request_id')!r}")
        _token_list("prompt_token_ids", d.get("prompt_token_ids"), empty=False)
        if not isinstance(d.get("params"), dict):
            raise ValueError("KV payload field params must be a map of SamplingParams fields")
        if not _is_int(d.get("priority"), None):
            raise ValueError(f"KV payload field priority must be an integer, got {d.get('priority')!r}")
        rows = d.get("completions")
        if not isinstance(rows, list) or not rows:
            raise ValueError("KV payload field completions must be a non-empty list")
        completions = [CompletionKV.from_wire(i, row) for i, row in enumerate(rows)]
        pool = _pool(d.get("pool"))
        for c in completions:
            if c.blocks is not None and pool is None:
                raise ValueError(f"KV payload field pool: completion {c.index} gives its blocks, and no pool holds "
                                 "them")
            c.pool = pool
        lora = d.get("lora")
        if lora is not None and not (isinstance(lora, list) and len(lora) == 3 and isinstance(lora[0], str)
                                     and _is_int(lora[1], 1) and isinstance(lora[2], str)):
            raise ValueError(f"KV payload field lora must be [name, id >= 1, path] or nil, got {lora!r}")
        draft = d.get("draft_layout")
        draft = None if draft is None else KVLayout.from_wire(draft, "draft_layout")
        return cls(layout, d["request_id"], d["prompt_token_ids"], d["params"], d["priority"], completions, pool,
                   lora, draft)

    def check_against(self, caches: list[CacheSpec]) -> None:
        """This payload fits an engine of these caches (its model's, then its draft model's if it has one):
        ValueError naming the first field that does not."""
        draft = caches[1].layout if len(caches) > 1 else None
        if (self.draft is None) != (draft is None):
            raise ValueError(f"KV payload field draft_layout: the KV comes {'with' if self.draft else 'without'} a "
                             f"draft model's, this engine runs {'one' if draft else 'none'} (speculative_config "
                             "draft_model): both engines need the same draft")
        for name, mine, theirs in (("layout", self.layout, caches[0].layout), ("draft_layout", self.draft, draft)):
            for f in fields(KVLayout) if mine is not None else ():
                if getattr(mine, f.name) != getattr(theirs, f.name):
                    raise ValueError(f"KV payload field {name}.{f.name} is {getattr(mine, f.name)!r}, this engine's "
                                     f"is {getattr(theirs, f.name)!r}")
        for i, c in enumerate(self.completions):
            c.check(caches, len(self.prompt_token_ids), f"completions[{i}]")


def _leading_blocks(data, num_layers: int, blocks: int, keep: int) -> bytes:
    """Of a part's bytes [layers, blocks, ...] (layers: every TP rank's), the first `keep` blocks of every layer."""
    view = memoryview(data).cast("B")
    layer = len(view) // num_layers
    size = layer // blocks * keep
    return b"".join(view[i * layer:i * layer + size] for i in range(num_layers))


def _pool(d) -> dict | None:
    """The payload's "pool" field checked: None, or {"pid", "fd", "token"} (a positive pid, an fd, a hex token)."""
    if d is None:
        return None
    if not (isinstance(d, dict) and set(d) == {"pid", "fd", "token"} and _is_int(d["pid"], 1)
            and _is_int(d["fd"], 0) and isinstance(d["token"], str) and len(d["token"]) == 32
            and all(ch in "0123456789abcdef" for ch in d["token"])):
        raise ValueError("KV payload field pool must be None or {pid, fd, token}: a process id, a file descriptor "
                         "and the pool's 32 hex digits")
    return {"pid": d["pid"], "fd": d["fd"], "token": d["token"]}


def _is_int(v, lo: int | None) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and (lo is None or v >= lo)


def _token_list(name: str, v, empty: bool) -> None:
    # type() rather than isinstance: a bool is no token id (and a prompt's thousands of ids are checked fast)
    if not isinstance(v, list) or (not v and not empty) or not all(type(t) is int for t in v) or (v and min(v) < 0):
        raise ValueError(f"KV payload field {name} must be a {'' if empty else 'non-empty '}list of token ids")
