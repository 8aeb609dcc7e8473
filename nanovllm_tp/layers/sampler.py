"""Rank 0's sampler, batched over a step's rows, reproducible per request.

On CPU (fp32 logits, C kernels built) all of it is one C pass per entry (csrc/sampler.c); the numpy/torch
code here is its reference and the path everywhere else.

Order of operations (vLLM's): raw logprobs are taken first; then the logit modifiers of scheduler/rows.py
(allowed set, bad words and min_tokens suppression, logit bias, penalties: repetition over prompt + output,
presence/frequency over output), temperature, min-p, top-k, top-p, and a draw. Each op runs on the rows that
need it only; an all-greedy plain batch is one argmax. A row that its modifiers leave without a logit above
-inf takes that row's argmax (column 0), drawn or not.

The draw is Gumbel-max with counter-based noise: a hash of (request seed, token index, vocab id) computed with
int64 tensor ops, so a request's samples depend only on its own seed and logits: not on the batch it shares,
not on the device.
"""
import numpy as np
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.sampling_params import MIN_TEMPERATURE
from nanovllm_tp.scheduler.rows import ALLOW, BIAS, MASK, PENALTY, ROW_DTYPE, SUPPRESS, Modifiers, SamplingBatch
from nanovllm_tp.scheduler.scheduled_step import PromptChunk, TokenLogprobs

_MASK64 = (1 << 64) - 1


def _as_int64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _MIX1, _MIX2 = _as_int64(0x9E3779B97F4A7C15), _as_int64(0xBF58476D1CE4E5B9), _as_int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift on int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def uniform_noise(seeds: torch.Tensor, index: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) for the vocab ids of each row (ids [vocab] shared, or [rows, k] per row), a pure
    function of (seed, index, vocab id)."""
    row_key = _splitmix64(_splitmix64(seeds) ^ index)
    mixed = _splitmix64(ids)
    mixed = mixed[None, :] if mixed.dim() == 1 else mixed
    bits = _shr(_splitmix64(row_key[:, None] ^ mixed), 11)   # 53 random bits
    return (bits.to(torch.float64) + 0.5) * (1.0 / (1 << 53))


_U64 = np.uint64


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def uniform_noise_np(seeds: np.ndarray, index: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """uniform_noise in numpy, bit for bit (uint64 arithmetic wraps like int64), for small candidate sets
    where torch's per-op cost dominates."""
    with np.errstate(over="ignore"):
        row_key = _splitmix64_np(_splitmix64_np(seeds.astype(_U64)) ^ index.astype(_U64))
        bits = _splitmix64_np(row_key[:, None] ^ _splitmix64_np(ids.astype(_U64))) >> _U64(11)
    return (bits.astype(np.float64) + 0.5) * (1.0 / (1 << 53))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value (the first on ties). On CPU numpy's argmax is several times faster
    than torch's (25 vs 175 us for 64 x 2003 fp32); same first-index tie rule."""
    if x.is_cpu:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    return x.argmax(dim=-1)


def token_logprobs(logits: torch.Tensor, rows: np.ndarray, chosen: np.ndarray, top_n: int) -> TokenLogprobs:
    """Log-softmax figures of some positions from logits [*, vocab]: position i is logits row rows[i] with
    its chosen token chosen[i]. A logprob is a logit less the row's logsumexp, and ranks and the top-N are the
    logits' own, so the normalised array is never made. On CPU one C pass per row."""
    kernels = cpu_kernels.for_tensor(logits) if logits.dtype is torch.float32 else None
    if kernels is not None:
        return TokenLogprobs(*kernels.row_logprobs(logits, rows, chosen, top_n))
    dev = logits.device
    logits = logits[_np(rows, dev)].float()
    lse = torch.logsumexp(logits, dim=1, keepdim=True)
    picked = logits.gather(1, _np(chosen, dev)[:, None])
    rank = (logits > picked).sum(dim=1) + 1
    if top_n:
        vals, ids = logits.topk(top_n, dim=-1)
        top_ids, top_lps = ids.cpu().numpy(), (vals - lse).cpu().numpy()
    else:
        top_ids, top_lps = np.zeros((len(chosen), 0), np.int64), np.zeros((len(chosen), 0), np.float32)
    return TokenLogprobs((picked - lse)[:, 0].cpu().numpy(), rank.cpu().numpy(), top_ids, top_lps)


# The record fields sampler.c reads, in its order, with the types it reads them as
_C_FIELDS = [("temperature", np.float32), ("top_p", np.float32), ("top_k", np.int32), ("min_p", np.float32),
             ("seed", np.int64), ("logprobs", np.int32), ("repetition_penalty", np.float32),
             ("frequency_penalty", np.float32), ("presence_penalty", np.float32)]
if any(ROW_DTYPE.fields[name][0] != np.dtype(t) for name, t in _C_FIELDS):
    raise ImportError("ROW_DTYPE changed a field sampler.c reads: update _C_FIELDS and sampler.c together")
_ROW_FIELDS = np.array([ROW_DTYPE.fields[name][1] for name, _ in _C_FIELDS], np.int64)


def _np(x: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.array(x, copy=True)).to(device)   # fields of a record array are strided


class Sampler:
    def __init__(self, eos_token_ids=()):
        self.eos = np.asarray(sorted(eos_token_ids), np.int64)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], TokenLogprobs | None]:
        """One token per entry of the batch, and the logprobs of the entries that asked for them."""
        logits = logits.float()
        mods = batch.modifiers(self.eos, logits.shape[1])
        kernels = cpu_kernels.for_tensor(logits)
        if kernels is not None:
            return self._sample_cpu(kernels, logits, batch, mods)
        if batch.logits_index is not None:
            logits = logits[_np(batch.logits_index, logits.device)]
        rows, raw = batch.rows, logits     # logprobs are the model's, as vLLM's: the modifiers work on a copy
        want_lp = np.flatnonzero(rows["logprobs"] >= 0)
        logits = _modify(logits, rows, mods)
        tokens = argmax_rows(logits)
        hot = np.flatnonzero(rows["temperature"] >= MIN_TEMPERATURE)
        if len(hot):
            tokens[_np(hot, tokens.device)] = self._draw(logits, batch, hot).to(tokens.device)
        tokens, lp = tokens.cpu().numpy(), None
        if len(want_lp):
            lp = token_logprobs(raw, want_lp, tokens[want_lp], int(rows["logprobs"][want_lp].max()))
        return tokens.tolist(), lp

    @torch.inference_mode()
    def modified(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """The logits each entry draws from ([entries, vocab], a copy): its row after its logit modifiers."""
        logits = logits.float()
        mods = batch.modifiers(self.eos, logits.shape[1])
        row_of = np.arange(len(batch)) if batch.logits_index is None else batch.logits_index
        kernels = cpu_kernels.for_tensor(logits)
        if kernels is not None:
            return kernels.modify_rows(logits, row_of, np.ascontiguousarray(batch.rows), _ROW_FIELDS, mods)
        return _modify(logits[_np(row_of, logits.device)], batch.rows, mods)

    def _sample_cpu(self, kernels, logits: torch.Tensor, batch: SamplingBatch, mods: Modifiers | None):
        """The same steps as the torch code, one C pass per entry (csrc/sampler.c). An all-greedy plain batch is
        one argmax."""
        rows = batch.rows
        row_of = np.arange(len(batch)) if batch.logits_index is None else batch.logits_index
        top_n = int(rows["logprobs"].max(initial=-1))
        if mods is None and top_n < 0 and not (rows["temperature"] >= MIN_TEMPERATURE).any():
            return np.argmax(logits.numpy(), axis=-1)[row_of].tolist(), None
        tokens, lp = kernels.sample(logits, row_of, np.ascontiguousarray(rows), _ROW_FIELDS, batch.sample_index, mods,
                                    MIN_TEMPERATURE, max(top_n, 0))
        return tokens.tolist(), (TokenLogprobs(*lp) if top_n >= 0 else None)

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, hot: np.ndarray) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p, then a Gumbel-max draw, for the rows with a temperature. Rows with a
        top-k draw among their k best candidates (small: numpy on the host); the others over the whole
        vocabulary (torch, on the logits' device)."""
        rows, dev, vocab = batch.rows[hot], logits.device, logits.shape[1]
        index = batch.sample_index[hot]
        out = torch.empty(len(hot), dtype=torch.int64)
        limited = (rows["top_k"] > 0) & (rows["top_k"] < vocab)
        group = np.flatnonzero(limited)
        if len(group):       # a temperature keeps the order: the k best logits are the k best scaled ones
            sub, k = logits[_np(hot[group], dev)], rows["top_k"][group].astype(np.int64)
            # ties of the k-th best value are kept too, as transformers and vLLM keep them: one candidate past the
            # largest k says whether a row has any (then they are counted over its row)
            vals, ids = sub.topk(int(k.max()) + 1, dim=-1)
            kth = vals.gather(1, _np(k - 1, dev)[:, None])
            tied = (vals.gather(1, _np(k, dev)[:, None]) == kth)[:, 0] & torch.isfinite(kth[:, 0])
            keep = k
            if tied.any():
                keep = torch.where(tied, (sub >= kth).sum(-1), _np(k, dev)).cpu().numpy()
                if keep.max() > vals.shape[1]:
                    vals, ids = sub.topk(int(keep.max()), dim=-1)
            scaled = vals.cpu().numpy() / rows["temperature"][group][:, None]
            out[torch.from_numpy(group)] = torch.from_numpy(
                _draw_candidates(scaled, ids.cpu().numpy(), keep, rows[group], index[group]))
        group = np.flatnonzero(~limited)
        if len(group):
            scaled = logits[_np(hot[group], dev)] / _np(rows["temperature"][group], dev)[:, None]
            out[torch.from_numpy(group)] = _draw_vocab(scaled, rows[group], index[group]).cpu()
        return out


def _modify(logits: torch.Tensor, rows: np.ndarray, mods: Modifiers | None) -> torch.Tensor:
    """The entries' logits [entries, vocab] after their modifiers (scheduler/rows.py), in a copy; as sampler.c
    computes them. Each kind works on its (entry, token) pairs, not on [entries, vocab], except ALLOW's mask."""
    if mods is None:
        return logits
    vocab, dev = logits.shape[1], logits.device
    logits = logits.clone(memory_format=torch.contiguous_format)
    entry, kind = mods.entry, mods.kind
    allow = kind == ALLOW
    if allow.any():
        masked, slot = np.unique(entry[allow], return_inverse=True)
        keep = torch.zeros(len(masked), vocab, dtype=torch.bool, device=dev)
        keep[_np(slot, dev), _np(mods.token[allow], dev)] = True
        index = _np(masked, dev)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    grammar = np.flatnonzero(kind == MASK)
    if len(grammar):
        keep = mask_bits(mods.masks[mods.token[grammar]], vocab)
        index = _np(entry[grammar], dev)
        logits[index] = logits[index].masked_fill(~torch.from_numpy(keep).to(dev), float("-inf"))
    flat = logits.view(-1)
    host = flat.numpy() if logits.is_cpu else None    # numpy's gather and scatter: cheaper than torch indexing here
    for k in (BIAS, PENALTY):
        pick = np.flatnonzero(kind == k)
        if not len(pick):
            continue
        r, where = entry[pick], entry[pick] * vocab + mods.token[pick]
        x = host[where] if host is not None else flat[_np(where, dev)].cpu().numpy()
        v = mods.value[pick]
        if k == BIAS:
            x = np.where(np.isfinite(x), x + v, x)       # a masked logit stays masked (penalties keep -inf too)
        else:
            rep = rows["repetition_penalty"][r]
            x = np.where(x > 0, x / rep, x * rep)
            x -= rows["frequency_penalty"][r] * v + rows["presence_penalty"][r] * (v > 0)
        if host is not None:
            host[where] = x
        else:
            flat[_np(where, dev)] = torch.from_numpy(x.astype(np.float32)).to(dev)
    off = np.flatnonzero(kind == SUPPRESS)
    if len(off):
        logits[_np(entry[off], dev), _np(mods.token[off], dev)] = float("-inf")
    return logits


def mask_bits(masks: np.ndarray, vocab: int) -> np.ndarray:
    """Bitmasks ([rows, words] int32, bit t: token t allowed) as bool [rows, vocab]; columns past the words are
    False."""
    bits = np.unpackbits(np.ascontiguousarray(masks, "<i4").view(np.uint8), axis=1, bitorder="little")
    keep = np.zeros((len(masks), vocab), np.bool_)
    width = min(vocab, bits.shape[1])
    keep[:, :width] = bits[:, :width]
    return keep


def _top_p_mask(vals, masked, top_p, lib):
    """Sorted candidates (best first): drop those after the kept mass has reached top_p (the first stays)."""
    z = lib.where(masked, -lib.inf, vals)
    probs = lib.exp(z - z[:, :1])
    probs = probs / probs.sum(-1, keepdims=True) if lib is np else probs / probs.sum(-1, keepdim=True)
    drop = (lib.cumsum(probs, -1) - probs) >= top_p[:, None]
    drop[:, 0] = False
    return masked | drop


def _draw_candidates(vals: np.ndarray, ids: np.ndarray, count: np.ndarray, rows: np.ndarray,
                     index: np.ndarray) -> np.ndarray:
    """One draw per row among its first count candidates (scaled logits sorted best first, and their vocab ids)."""
    masked = np.arange(vals.shape[1])[None, :] >= count[:, None]
    if (rows["min_p"] > 0).any():            # p < min_p * p_max  <=>  scaled < max + log(min_p)
        with np.errstate(divide="ignore"):
            masked |= vals < vals[:, :1] + np.log(rows["min_p"])[:, None]
    if (rows["top_p"] < 1).any():
        with np.errstate(invalid="ignore"):      # a row of nothing but -inf: NaN masses, no candidate dropped
            masked = _top_p_mask(vals, masked, rows["top_p"], np)
    noise = uniform_noise_np(rows["seed"], index, ids)
    scores = np.where(masked, -np.inf, vals.astype(np.float64)) - np.log(-np.log(noise))
    picks = ids[np.arange(len(ids)), np.argmax(scores, axis=1)]
    return np.where(np.isneginf(vals[:, 0]), 0, picks)      # nothing but -inf: column 0, as the argmax


def _draw_vocab(scaled: torch.Tensor, rows: np.ndarray, index: np.ndarray) -> torch.Tensor:
    """One draw per row over the whole vocabulary (sorted first when a row has a top-p)."""
    dev = scaled.device
    if (rows["top_p"] < 1).any():       # stable: equal logits in column order (nothing but -inf: column 0 first)
        vals, ids = scaled.sort(dim=-1, descending=True, stable=True)
    else:
        vals, ids = scaled, torch.arange(scaled.shape[1], device=dev)
    masked = torch.zeros_like(vals, dtype=torch.bool)
    if (rows["min_p"] > 0).any():
        masked |= vals < vals.max(dim=-1, keepdim=True).values + torch.log(_np(rows["min_p"], dev))[:, None]
    if (rows["top_p"] < 1).any():
        masked = _top_p_mask(vals, masked, _np(rows["top_p"], dev), torch)
    noise = uniform_noise(_np(rows["seed"], dev), _np(index, dev), ids)
    pick = argmax_rows(vals.double().masked_fill(masked, float("-inf")) - torch.log(-torch.log(noise))).to(dev)
    return pick if ids.dim() == 1 else ids.gather(1, pick[:, None])[:, 0]


def prompt_logprobs(logits: torch.Tensor, chunks: list[PromptChunk]) -> list[TokenLogprobs]:
    """The logprobs of each chunk's prompt tokens (the scheduler records them)."""
    return [token_logprobs(logits, c.rows, c.token_ids, c.seq.params.prompt_logprobs) for c in chunks]


def run_worst_case(device: torch.device, rows: int, vocab: int) -> None:
    """Sample a full batch with every knob on, so memory profiling sees the sampler's peak temporaries."""
    from nanovllm_tp.sampling_params import MAX_LOGPROBS, SamplingParams
    from nanovllm_tp.scheduler.rows import rows_of
    from nanovllm_tp.scheduler.sequence import Sequence
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=0.5, logprobs=MAX_LOGPROBS, logit_bias={0: 1.0},
                            allowed_token_ids=[0])
    seqs = [Sequence(i, [i % vocab], params, seed=i) for i in range(rows)]
    batch = SamplingBatch(seqs, rows_of(seqs), np.zeros(rows, np.int64))
    Sampler()(torch.zeros(rows, vocab, device=device), batch)
