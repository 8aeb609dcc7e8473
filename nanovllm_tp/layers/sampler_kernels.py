"""The bridge to rank 0's sampler kernels (csrc/sampler.c, over fp32 logits): per-row logprobs and top-n, one pass
per entry from the logit modifiers to the drawn token, and the modified rows alone. A part of CpuKernels
(layers/cpu_kernels.py), which binds the C functions these methods call.
"""
import numpy as np
import torch


class SamplerKernels:
    def row_logprobs(self, x, row_of: np.ndarray, chosen: np.ndarray, top_n: int):
        """For each entry, row row_of[e] of x ([rows, vocab] fp32): the logprob and rank of column chosen[e], and
        the row's top_n columns and their logprobs (as sampler.token_logprobs)."""
        x = _rows_contiguous(x)
        row_of, chosen = np.ascontiguousarray(row_of, np.int64), np.ascontiguousarray(chosen, np.int64)
        n = len(row_of)
        logprob, rank = np.empty(n, np.float32), np.empty(n, np.int64)
        top_lps, top_ids = np.empty((n, top_n), np.float32), np.empty((n, top_n), np.int64)
        if self._row_logprobs(x.data_ptr(), n, x.shape[1], x.stride(0), row_of.ctypes.data, chosen.ctypes.data,
                              top_n, logprob.ctypes.data, rank.ctypes.data, top_lps.ctypes.data, top_ids.ctypes.data):
            raise MemoryError("the CPU logprobs kernel could not allocate its scratch")
        return logprob, rank, top_ids, top_lps

    def sample(self, x, row_of: np.ndarray, records: np.ndarray, offsets: np.ndarray, counter: np.ndarray, mods,
               min_temperature: float, top_n: int):
        """One token per entry, and the logprobs of the entries that want them: see sample_rows in sampler.c.
        records: the entries' records (contiguous), offsets: int64 byte offsets of their fields in its order;
        mods: the step's scheduler.rows.Modifiers (None: no entry has any)."""
        x = _rows_contiguous(x)
        n = len(row_of)
        with_lp = int((records["logprobs"] >= 0).sum())
        tokens = np.empty(n, np.int64)
        logprob, rank = np.empty(with_lp, np.float32), np.empty(with_lp, np.int64)
        top_lps, top_ids = np.empty((with_lp, top_n), np.float32), np.empty((with_lp, top_n), np.int64)
        row_of, counter = np.ascontiguousarray(row_of, np.int64), np.ascontiguousarray(counter, np.int64)
        start, token, kind, value, masks = _mod_arrays(mods, n)
        if not records.flags.c_contiguous:
            raise ValueError("sample: the records must be contiguous")
        if self._sample_rows(x.data_ptr(), x.stride(0), x.shape[1], n, row_of.ctypes.data, records.ctypes.data,
                             records.itemsize, offsets.ctypes.data, counter.ctypes.data, start.ctypes.data,
                             token.ctypes.data, kind.ctypes.data, value.ctypes.data, masks.ctypes.data,
                             masks.shape[1], min_temperature,
                             tokens.ctypes.data, top_n, logprob.ctypes.data, rank.ctypes.data, top_lps.ctypes.data,
                             top_ids.ctypes.data):
            raise MemoryError("the CPU sampler could not allocate its scratch")
        return tokens, (logprob, rank, top_ids, top_lps)

    def modify_rows(self, x, row_of: np.ndarray, records: np.ndarray, offsets: np.ndarray, mods) -> torch.Tensor:
        """The entries' rows of x after their logit modifiers, as sample() draws from them: [entries, vocab]."""
        x = _rows_contiguous(x)
        n = len(row_of)
        out = torch.empty(n, x.shape[1], dtype=torch.float32)
        row_of = np.ascontiguousarray(row_of, np.int64)
        start, token, kind, value, masks = _mod_arrays(mods, n)
        if not records.flags.c_contiguous:
            raise ValueError("modify_rows: the records must be contiguous")
        self._modify_rows(x.data_ptr(), x.stride(0), x.shape[1], n, row_of.ctypes.data, records.ctypes.data,
                          records.itemsize, offsets.ctypes.data, start.ctypes.data, token.ctypes.data,
                          kind.ctypes.data, value.ctypes.data, masks.ctypes.data, masks.shape[1], out.data_ptr())
        return out


_NO_MASKS = np.zeros((0, 1), np.int32)


def _mod_arrays(mods, entries: int) -> list[np.ndarray]:
    """A Modifiers' arrays as sampler.c reads them (no items for None), its bitmasks last ([masks, words])."""
    if mods is None:
        return [np.zeros(entries + 1, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.float32),
                _NO_MASKS]
    masks = _NO_MASKS if mods.masks is None else np.ascontiguousarray(mods.masks, np.int32)
    return [np.ascontiguousarray(a, t) for a, t in ((mods.start, np.int64), (mods.token, np.int64),
                                                     (mods.kind, np.int32), (mods.value, np.float32))] + [masks]


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
