"""Rank 0's sampler, batched over a step's rows, reproducible per request.

On CPU (fp32 logits, C kernels built) all of it is one C pass per entry (csrc/sampler.c); the numpy/torch
code here is its reference and the path everywhere else.

Order of operations (vLLM's): raw logprobs are taken first; then the logit modifiers of scheduler/rows.py
(allowed set, bad words and min_tokens suppression, logit bias, penalties: repetition over prompt + output,
presence/frequency over output), temperature, min-p, top-k, top-p, and a draw. Each op runs on the rows that
need it only; an all-greedy plain batch is one argmax. A row that its modifiers leave without a logit above
-inf takes that row's argmax (column 0), drawn or not.

The draw is Gumbel-max with counter-based noise (sampling_noise.py), so a request's samples depend only on its
own seed and logits. This file picks the path: csrc/sampler.c on CPU (the record fields it reads, _C_FIELDS), else
sampler_torch.py (the reference).
"""
import numpy as np
import torch

from nanovllm_tp.layers import cpu_kernels
from nanovllm_tp.layers.sampler_torch import argmax_rows, draw, mask_bits, modify, tensor_of
from nanovllm_tp.layers.sampling_noise import uniform_noise, uniform_noise_np
from nanovllm_tp.sampling_params import MIN_TEMPERATURE
from nanovllm_tp.scheduler.rows import ROW_DTYPE, Modifiers, SamplingBatch
from nanovllm_tp.scheduler.scheduled_step import PromptChunk, TokenLogprobs

__all__ = ["Sampler", "token_logprobs", "prompt_logprobs", "run_worst_case", "argmax_rows", "mask_bits",
           "uniform_noise", "uniform_noise_np"]


def token_logprobs(logits: torch.Tensor, rows: np.ndarray, chosen: np.ndarray, top_n: int) -> TokenLogprobs:
    """Log-softmax figures of some positions from logits [*, vocab]: position i is logits row rows[i] with
    its chosen token chosen[i]. A logprob is a logit less the row's logsumexp, and ranks and the top-N are the
    logits' own, so the normalised array is never made. On CPU one C pass per row."""
    kernels = cpu_kernels.for_tensor(logits) if logits.dtype is torch.float32 else None
    if kernels is not None:
        return TokenLogprobs(*kernels.row_logprobs(logits, rows, chosen, top_n))
    dev = logits.device
    logits = logits[tensor_of(rows, dev)].float()
    lse = torch.logsumexp(logits, dim=1, keepdim=True)
    picked = logits.gather(1, tensor_of(chosen, dev)[:, None])
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
            logits = logits[tensor_of(batch.logits_index, logits.device)]
        rows, raw = batch.rows, logits     # logprobs are the model's, as vLLM's: the modifiers work on a copy
        want_lp = np.flatnonzero(rows["logprobs"] >= 0)
        logits = modify(logits, rows, mods)
        tokens = argmax_rows(logits)
        hot = np.flatnonzero(rows["temperature"] >= MIN_TEMPERATURE)
        if len(hot):
            tokens[tensor_of(hot, tokens.device)] = draw(logits, batch, hot).to(tokens.device)
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
        return modify(logits[tensor_of(row_of, logits.device)], batch.rows, mods)

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


def prompt_logprobs(logits: torch.Tensor, chunks: list[PromptChunk]) -> list[TokenLogprobs]:
    """The logprobs of each chunk's prompt tokens (the scheduler records them)."""
    return [token_logprobs(logits, c.rows, c.token_ids, c.seq.params.prompt_logprobs) for c in chunks]


def run_worst_case(device: torch.device, rows: int, vocab: int, max_logprobs: int) -> None:
    """Sample a full batch with every knob on (as many logprobs as max_logprobs allows), so memory profiling sees
    the sampler's peak temporaries."""
    from nanovllm_tp.sampling_params import SamplingParams
    from nanovllm_tp.scheduler.rows import rows_of
    from nanovllm_tp.scheduler.sequence import Sequence
    top_n = vocab if max_logprobs < 0 else min(max_logprobs, vocab)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=0.5, logprobs=top_n, logit_bias={0: 1.0},
                            allowed_token_ids=[0])
    seqs = [Sequence(i, [i % vocab], params, seed=i) for i in range(rows)]
    batch = SamplingBatch(seqs, rows_of(seqs), np.zeros(rows, np.int64))
    Sampler()(torch.zeros(rows, vocab, device=device), batch)
