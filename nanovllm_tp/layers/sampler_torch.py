"""The sampler's torch path: the reference of csrc/sampler.c, and the path on every device where the C kernels do
not run (scheduler/rows.py's logit modifiers, then temperature, min-p, top-k, top-p and a Gumbel-max draw).
Each op runs on the rows that need it only; a row that its modifiers leave without a logit above -inf takes its
argmax (column 0), drawn or not."""
import numpy as np
import torch

from nanovllm_tp.layers.sampling_noise import uniform_noise, uniform_noise_np
from nanovllm_tp.scheduler.rows import ALLOW, BIAS, MASK, PENALTY, SUPPRESS, Modifiers, SamplingBatch


def tensor_of(x: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(np.array(x, copy=True)).to(device)   # fields of a record array are strided


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's largest value (the first on ties). On CPU numpy's argmax is several times faster
    than torch's (25 vs 175 us for 64 x 2003 fp32); same first-index tie rule."""
    if x.is_cpu:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    return x.argmax(dim=-1)


def modify(logits: torch.Tensor, rows: np.ndarray, mods: Modifiers | None) -> torch.Tensor:
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
        keep[tensor_of(slot, dev), tensor_of(mods.token[allow], dev)] = True
        index = tensor_of(masked, dev)
        logits[index] = logits[index].masked_fill(~keep, float("-inf"))
    grammar = np.flatnonzero(kind == MASK)
    if len(grammar):
        keep = mask_bits(mods.masks[mods.token[grammar]], vocab)
        index = tensor_of(entry[grammar], dev)
        logits[index] = logits[index].masked_fill(~torch.from_numpy(keep).to(dev), float("-inf"))
    flat = logits.view(-1)
    host = flat.numpy() if logits.is_cpu else None    # numpy's gather and scatter: cheaper than torch indexing here
    for k in (BIAS, PENALTY):
        pick = np.flatnonzero(kind == k)
        if not len(pick):
            continue
        r, where = entry[pick], entry[pick] * vocab + mods.token[pick]
        x = host[where] if host is not None else flat[tensor_of(where, dev)].cpu().numpy()
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
            flat[tensor_of(where, dev)] = torch.from_numpy(x.astype(np.float32)).to(dev)
    off = np.flatnonzero(kind == SUPPRESS)
    if len(off):
        logits[tensor_of(entry[off], dev), tensor_of(mods.token[off], dev)] = float("-inf")
    return logits


def mask_bits(masks: np.ndarray, vocab: int) -> np.ndarray:
    """Bitmasks ([rows, words] int32, bit t: token t allowed) as bool [rows, vocab]; columns past the words are
    False."""
    bits = np.unpackbits(np.ascontiguousarray(masks, "<i4").view(np.uint8), axis=1, bitorder="little")
    keep = np.zeros((len(masks), vocab), np.bool_)
    width = min(vocab, bits.shape[1])
    keep[:, :width] = bits[:, :width]
    return keep


def draw(logits: torch.Tensor, batch: SamplingBatch, hot: np.ndarray) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, then a Gumbel-max draw, for the rows with a temperature. Rows with a
    top-k draw among their k best candidates (small: numpy on the host); the others over the whole
    vocabulary (torch, on the logits' device)."""
    rows, dev, vocab = batch.rows[hot], logits.device, logits.shape[1]
    index = batch.sample_index[hot]
    out = torch.empty(len(hot), dtype=torch.int64)
    limited = (rows["top_k"] > 0) & (rows["top_k"] < vocab)
    group = np.flatnonzero(limited)
    if len(group):       # a temperature keeps the order: the k best logits are the k best scaled ones
        sub, k = logits[tensor_of(hot[group], dev)], rows["top_k"][group].astype(np.int64)
        # ties of the k-th best value are kept too, as transformers and vLLM keep them: one candidate past the
        # largest k says whether a row has any (then they are counted over its row)
        vals, ids = sub.topk(int(k.max()) + 1, dim=-1)
        kth = vals.gather(1, tensor_of(k - 1, dev)[:, None])
        tied = (vals.gather(1, tensor_of(k, dev)[:, None]) == kth)[:, 0] & torch.isfinite(kth[:, 0])
        keep = k
        if tied.any():
            keep = torch.where(tied, (sub >= kth).sum(-1), tensor_of(k, dev)).cpu().numpy()
            if keep.max() > vals.shape[1]:
                vals, ids = sub.topk(int(keep.max()), dim=-1)
        scaled = vals.cpu().numpy() / rows["temperature"][group][:, None]
        out[torch.from_numpy(group)] = torch.from_numpy(
            _draw_candidates(scaled, ids.cpu().numpy(), keep, rows[group], index[group]))
    group = np.flatnonzero(~limited)
    if len(group):
        scaled = logits[tensor_of(hot[group], dev)] / tensor_of(rows["temperature"][group], dev)[:, None]
        out[torch.from_numpy(group)] = _draw_vocab(scaled, rows[group], index[group]).cpu()
    return out


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
        masked |= vals < vals.max(dim=-1, keepdim=True).values + torch.log(tensor_of(rows["min_p"], dev))[:, None]
    if (rows["top_p"] < 1).any():
        masked = _top_p_mask(vals, masked, tensor_of(rows["top_p"], dev), torch)
    noise = uniform_noise(tensor_of(rows["seed"], dev), tensor_of(index, dev), ids)
    pick = argmax_rows(vals.double().masked_fill(masked, float("-inf")) - torch.log(-torch.log(noise))).to(dev)
    return pick if ids.dim() == 1 else ids.gather(1, pick[:, None])[:, 0]
