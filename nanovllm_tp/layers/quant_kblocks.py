"""GGUF's K-quants (Q4_K, Q5_K, Q6_K: super-blocks of 256 inputs) and the 5-bit types llama.cpp writes where a
row is not whole super-blocks (Q5_0, Q5_1), unpacked once at load into blocks of 32 that csrc/linear_q.c packs.

The file's layouts (ggml's, as the gguf package's dequantizers read them):
- Q5_0 [fp16 d][4 bytes: bit 4 of each of the 32 q][16 bytes of 4-bit pairs]: w = d * (q - 16);
  Q5_1 the same with an fp16 min m after d: w = d * q + m.
- Q4_K [fp16 d][fp16 dmin][12 bytes: eight 6-bit scales sc and mins mn][128 bytes: 4 chunks of 32, sub-block
  2c in chunk c's low nibbles, 2c + 1 in its high]: w = (d * sc) * q - dmin * mn per sub-block of 32;
  Q5_K adds 32 bytes of fifth bits (bit i of byte j: sub-block i's quant j) before the nibbles.
- Q6_K [128 bytes of low nibbles][64 bytes of 2-bit highs][16 int8 scales][fp16 d]: w = (d * sc) * (q - 32) per
  sub-block of 16.

The unpacked raw block (per row and block of 32, what pack_q_weight reads): Q5_0 / Q5_1 [fp16 d][fp16 m (0 for
Q5_0)][32 u8 q]; the K-quants [fp16 d][fp16 dmin (0 for Q6_K)][u8 sc][u8 mn, or for Q6_K: int8 sc of each half of
16][32 u8 q], the super-block's d and dmin repeated in each of its 8 blocks. The kernel forms d * sc and dmin * mn
in fp32 (w = (d * sc) * q - dmin * mn; Q6_K (d * sc_half) * (q - 32)): products of an fp16 and a 6- or 8-bit
integer are exact there, so its weights are the file's to the bit. It packs each quant back into a nibble and the
bits above it (one, or Q6_K's two) into planes of their own: the file's bits per weight in memory.
"""
import numpy as np

QK_K = 256
SUPER = {12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}      # ggml type -> name: super-blocks of 256
FIVE = {6: "Q5_0", 7: "Q5_1"}                     # blocks of 32, the fifth bit apart
BLOCK_SIZE = {12: QK_K, 13: QK_K, 14: QK_K, 6: 32, 7: 32}
BLOCK_BYTES = {12: 144, 13: 176, 14: 210, 6: 22, 7: 24}


def unpack(data: np.ndarray, qtype: int) -> np.ndarray:
    """The file's rows [n, bytes] of qtype as pack_q_weight's raw blocks of 32: [n, k / 32 * (36 or 38)] uint8."""
    n = data.shape[0]
    blocks = np.ascontiguousarray(data).reshape(-1, BLOCK_BYTES[qtype])
    if qtype in FIVE:
        head, q = _five(blocks, qtype)
    else:
        head, q = (_q6_k if qtype == 14 else _q45_k)(blocks, qtype)
    return np.concatenate([head, q], axis=-1).reshape(n, -1)


def to_q8_0(data: np.ndarray, qtype: int) -> np.ndarray:
    """Rows of Q4_0 or Q5_0 blocks as Q8_0 blocks of the same values (d, and q - 8 or q - 16 as int8): lossless,
    for a merged layer whose parts come in these types beside Q8_0 (llama.cpp's Q4_K_M: q, k in Q5_0, v in
    Q8_0)."""
    n = data.shape[0]
    size = 18 if qtype == 2 else 22
    blocks = np.ascontiguousarray(data).reshape(-1, size)
    if qtype == 2:
        q = _nibbles(blocks[:, 2:], 16).reshape(-1, 32).astype(np.int8) - 8
    else:
        q = _five(blocks, qtype)[1].astype(np.int8) - 16
    return np.concatenate([blocks[:, :2], q.view(np.uint8)], axis=-1).reshape(n, -1)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[blocks, chunks * width] bytes -> [blocks, 2 * chunks, width]: a chunk's low nibbles, then its high ones."""
    pairs = qs.reshape(qs.shape[0], -1, 1, width) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (pairs & 0x0F).reshape(qs.shape[0], -1, width)


def _five(blocks: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    head = 2 if qtype == 6 else 4
    high = blocks[:, head:head + 4].copy().view("<u4")            # [blocks, 1]
    bits = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = _nibbles(blocks[:, head + 4:], 16).reshape(-1, 32) | bits << 4
    scales = np.zeros((blocks.shape[0], 4), np.uint8)
    scales[:, :head] = blocks[:, :head]
    return scales, q


def _q45_k(blocks: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    from gguf.quants import Q4_K
    nbl = blocks.shape[0]
    sc, mn = Q4_K.get_scale_min(blocks[:, 4:16])                  # [blocks, 8] each
    q = _nibbles(blocks[:, -128:], 32)                            # [blocks, 8, 32]
    if qtype == 13:
        high = blocks[:, 16:48].reshape(nbl, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = q | (high & 1) << 4
    return _heads(blocks[:, :4], np.stack([sc, mn], axis=-1)), q.reshape(-1, 32)


def _q6_k(blocks: np.ndarray, qtype: int) -> tuple[np.ndarray, np.ndarray]:
    nbl = blocks.shape[0]
    low = _nibbles(blocks[:, :128], 64).reshape(nbl, 8, 32)
    high = blocks[:, 128:192].reshape(nbl, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    q = low | (high & 3).reshape(nbl, 8, 32) << 4
    d = np.concatenate([blocks[:, 208:210], np.zeros((nbl, 2), np.uint8)], axis=1)
    return _heads(d, blocks[:, 192:208].reshape(nbl, 8, 2)), q.reshape(-1, 32)


def _heads(supers: np.ndarray, subs: np.ndarray) -> np.ndarray:
    """[blocks, 4] fp16 d and dmin bytes and [blocks, 8, 2] sub-block bytes -> [blocks * 8, 6]: the raw heads."""
    per_block = np.broadcast_to(supers[:, None], (supers.shape[0], 8, 4))
    return np.concatenate([per_block, subs.astype(np.uint8)], axis=-1).reshape(-1, 6)
