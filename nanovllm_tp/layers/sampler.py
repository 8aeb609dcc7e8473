"""Rank 0's sampler, batched over a step's rows, reproducible per request.

Order of operations (vLLM's): raw logprobs are taken first; then min_tokens suppression, penalties
(repetition over prompt + output, presence/frequency over output), temperature, min-p, top-k, top-p, and a
draw. Each op runs on the rows that need it only; an all-greedy plain batch is one argmax.

The draw is Gumbel-max with counter-based noise: a hash of (request seed, token index, vocab id) computed with
int64 tensor ops, so a request's samples depend only on its own seed and logits: not on the batch it shares,
not on the device.
"""
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm_tp.sampling_params import MIN_TEMPERATURE
from nanovllm_tp.scheduler.rows import SamplingBatch

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


def uniform_noise(seeds: torch.Tensor, index: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, vocab] uniforms in (0, 1), a pure function of (seed, index, vocab id)."""
    row_key = _splitmix64(_splitmix64(seeds) ^ index)
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _shr(_splitmix64(row_key[:, None] ^ _splitmix64(ids)[None, :]), 11)   # 53 random bits
    return (bits.to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value (the first on ties). On CPU numpy's argmax is several times faster
    than torch's (25 vs 175 us for 64 x 2003 fp32); same first-index tie rule."""
    if x.is_cpu:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    return x.argmax(dim=-1)


@dataclass(slots=True)
class TokenLogprobs:
    """Logprobs of some positions: the chosen token's logprob and rank (1 = most likely) and the top-N."""
    logprob: np.ndarray       # float32 [positions]
    rank: np.ndarray          # int64 [positions]
    top_ids: np.ndarray       # int64 [positions, N]
    top_logprobs: np.ndarray  # float32 [positions, N]


def token_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, top_n: int) -> TokenLogprobs:
    """From normalised logprobs [positions, vocab] and the chosen token of each position."""
    picked = logprobs.gather(1, chosen[:, None])
    rank = (logprobs > picked).sum(dim=1) + 1
    top = logprobs.topk(top_n, dim=1) if top_n else None
    return TokenLogprobs(picked[:, 0].cpu().numpy(), rank.cpu().numpy(),
                         top.indices.cpu().numpy() if top else np.zeros((len(chosen), 0), np.int64),
                         top.values.cpu().numpy() if top else np.zeros((len(chosen), 0), np.float32))


def _np(x: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.array(x, copy=True)).to(device)   # fields of a record array are strided


class Sampler:
    def __init__(self, eos_token_ids=()):
        self.eos = np.asarray(sorted(eos_token_ids), np.int64)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[list[int], TokenLogprobs | None]:
        """One token per entry of the batch, and the logprobs of the entries that asked for them."""
        if batch.logits_index is not None:
            logits = logits[_np(batch.logits_index, logits.device)]
        logits = logits.float()
        rows, dev = batch.rows, logits.device
        want_lp = np.flatnonzero(rows["logprobs"] >= 0)
        raw_lp = torch.log_softmax(logits[_np(want_lp, dev)], dim=-1) if len(want_lp) else None
        logits = self._suppress(logits, batch)
        logits = self._penalize(logits, batch)
        tokens = argmax_rows(logits)
        hot = np.flatnonzero(rows["temperature"] >= MIN_TEMPERATURE)
        if len(hot):
            tokens[_np(hot, tokens.device)] = self._draw(logits, batch, hot).to(tokens.device)
        lp = None
        if raw_lp is not None:
            lp = token_logprobs(raw_lp, tokens.to(dev)[_np(want_lp, dev)], int(rows["logprobs"][want_lp].max()))
        return tokens.tolist(), lp

    def _suppress(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        entries, ids = batch.suppressed(self.eos)
        ok = ids < logits.shape[1]
        if ok.any():
            logits = logits.clone()
            logits[_np(entries[ok], logits.device), _np(ids[ok], logits.device)] = float("-inf")
        return logits

    def _penalize(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        rows = batch.rows
        need = np.flatnonzero((rows["repetition_penalty"] != 1) | (rows["presence_penalty"] != 0)
                              | (rows["frequency_penalty"] != 0))
        if not len(need):
            return logits
        dev, vocab = logits.device, logits.shape[1]
        local = np.full(len(rows), -1, np.int64)
        local[need] = np.arange(len(need))
        entry, token, is_out = batch.penalty_tokens(need)
        keep = token < vocab
        entry, token, is_out = _np(local[entry[keep]], dev), _np(token[keep], dev), _np(is_out[keep], dev)
        seen = torch.zeros(len(need), vocab, dtype=torch.bool, device=dev)
        seen[entry, token] = True
        out_counts = torch.zeros(len(need), vocab, dtype=torch.float32, device=dev)
        out_counts.index_put_((entry, token), is_out.float(), accumulate=True)
        sub = logits[_np(need, dev)]
        rep = _np(rows["repetition_penalty"][need], dev)[:, None]
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - _np(rows["frequency_penalty"][need], dev)[:, None] * out_counts
        sub = sub - _np(rows["presence_penalty"][need], dev)[:, None] * (out_counts > 0).float()
        logits = logits.clone()
        logits[_np(need, dev)] = sub
        return logits

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch, hot: np.ndarray) -> torch.Tensor:
        """Temperature, min-p, top-k, top-p, then a Gumbel-max draw, for the rows with a temperature."""
        rows, dev = batch.rows[hot], logits.device
        scaled = logits[_np(hot, dev)] / _np(rows["temperature"], dev)[:, None]
        vocab = scaled.shape[1]
        masked = torch.zeros_like(scaled, dtype=torch.bool)
        sel = np.flatnonzero(rows["min_p"] > 0)
        if len(sel):
            probs = torch.softmax(scaled[_np(sel, dev)], dim=-1)
            floor = _np(rows["min_p"][sel], dev)[:, None] * probs.max(dim=-1, keepdim=True).values
            masked[_np(sel, dev)] |= probs < floor
        sel = np.flatnonzero((rows["top_k"] > 0) & (rows["top_k"] < vocab))
        if len(sel):
            k = _np(rows["top_k"][sel].astype(np.int64), dev)
            sub = scaled[_np(sel, dev)].masked_fill(masked[_np(sel, dev)], float("-inf"))
            kth = sub.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])
            masked[_np(sel, dev)] |= sub < kth
        sel = np.flatnonzero(rows["top_p"] < 1)
        if len(sel):
            sub = scaled[_np(sel, dev)].masked_fill(masked[_np(sel, dev)], float("-inf"))
            probs, order = torch.softmax(sub, dim=-1).sort(dim=-1, descending=True)
            before = probs.cumsum(dim=-1) - probs            # mass of the tokens ranked above each one
            drop_sorted = before >= _np(rows["top_p"][sel], dev)[:, None]
            drop_sorted[:, 0] = False
            masked[_np(sel, dev)] |= torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logp = torch.log_softmax(scaled.masked_fill(masked, float("-inf")), dim=-1).double()
        noise = uniform_noise(_np(rows["seed"], dev), _np(batch.sample_index[hot], dev), vocab)
        return argmax_rows(logp - torch.log(-torch.log(noise)))


def prompt_logprobs(logits: torch.Tensor, chunks) -> None:
    """Append the logprobs of each chunk's prompt tokens to its sequence: logits row j of a chunk starting at
    position p predicts the prompt token at p + j + 1. Positions already recorded (a recomputed chunk after
    preemption) are skipped."""
    for seq, first_row, first_pos, count in chunks:
        have = len(seq.prompt_logprobs)
        targets = [p + 1 for p in range(first_pos, first_pos + count) if have <= p + 1 < seq.num_prompt_tokens]
        if not targets:
            continue
        idx = torch.tensor([first_row + t - 1 - first_pos for t in targets], device=logits.device)
        chosen = torch.tensor([seq.token_ids[t] for t in targets], device=logits.device)
        lp = token_logprobs(torch.log_softmax(logits[idx].float(), dim=-1), chosen, seq.params.prompt_logprobs)
        seq.prompt_logprobs.extend(zip(lp.logprob.tolist(), lp.rank.tolist(), lp.top_ids, lp.top_logprobs))


def run_worst_case(device: torch.device, rows: int, vocab: int) -> None:
    """Sample a full batch with every knob on, so memory profiling sees the sampler's peak temporaries."""
    from nanovllm_tp.sampling_params import MAX_LOGPROBS, SamplingParams
    from nanovllm_tp.scheduler.rows import rows_of
    from nanovllm_tp.scheduler.sequence import Sequence
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=0.5, logprobs=MAX_LOGPROBS)
    seqs = [Sequence(i, [i % vocab], params, seed=i) for i in range(rows)]
    batch = SamplingBatch(seqs, rows_of(seqs), np.zeros(rows, np.int64))
    Sampler()(torch.zeros(rows, vocab, device=device), batch)
