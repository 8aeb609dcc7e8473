"""Every sampling knob on both samplers (the C pass the CPU takes, the numpy/torch code of other devices) against
transformers' own logits processors, on rows that hold positive, negative, zero, -inf and tied logits, in fp32 and
in bf16 (the model's logits rounded as a bf16 model gives them):
- repetition penalty: the processed logits equal `RepetitionPenaltyLogitsProcessor`'s;
- temperature, top-k, top-p, min-p: the set of tokens drawn over many seeds is exactly the set the warper keeps,
  and the draws follow the softmax of the warped logits (chi-square).
Ties at the top-k boundary are all kept, as transformers and vLLM keep them."""
import numpy as np
import pytest
import torch
from transformers import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper,
                          TopKLogitsWarper, TopPLogitsWarper)

from nanovllm_tp.layers.sampler import Sampler
from nanovllm_tp.sampling_params import SamplingParams
from tests.unit.test_logits_modifiers import assert_same_logits
from tests.unit.test_sampler import batch_of, chi_square_ok

NEG = float("-inf")
DRAWS = 12000


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request):
    return request.param


def special_row(vocab: int, seed: int, dtype) -> torch.Tensor:
    """Logits over [-3, 3], shuffled: two equal maxima (3.0), a 2.0, three equal 1.5s, then values below 1.2 among
    which zeros, negative ties and -inf; rounded to dtype."""
    g = np.random.default_rng(seed)
    row = g.uniform(-3.0, 1.2, vocab).astype(np.float32)
    row[:12] = [3.0, 3.0, 2.0, 1.5, 1.5, 1.5, 0.0, 0.0, -1.0, -1.0, NEG, NEG]
    row[-3:] = [NEG, -0.5, 0.0]
    return torch.from_numpy(g.permutation(row)).to(dtype)


def warped(row: torch.Tensor, *warpers) -> torch.Tensor:
    """transformers' processed logits of one row (fp32, as our samplers read any dtype)."""
    scores = row.float()[None].clone()
    ids = torch.zeros(1, 1, dtype=torch.long)
    for w in warpers:
        scores = w(ids, scores)
    return scores[0]


def drawn(row: torch.Tensor, params: SamplingParams, n: int = DRAWS) -> np.ndarray:
    batch = batch_of([params] * n, seeds=[i * 7919 + 1 for i in range(n)])
    tokens, _ = Sampler()(row[None].repeat(n, 1), batch)
    return np.bincount(tokens, minlength=row.shape[-1])


def check_draws(both_paths, row: torch.Tensor, params: SamplingParams, want: torch.Tensor) -> None:
    """On both samplers: draws land on exactly the tokens transformers keeps, distributed as its softmax."""
    kept = set(torch.nonzero(torch.isfinite(want)).flatten().tolist())
    probs = torch.softmax(want.double(), -1).numpy()
    surely = set(np.flatnonzero(probs * DRAWS >= 20).tolist())     # each missed with probability < e^-20
    assert surely <= kept
    for counts in both_paths(lambda: drawn(row, params)):
        got = set(np.flatnonzero(counts).tolist())
        assert got <= kept, f"drawn outside transformers' kept set: {sorted(got - kept)}"
        assert surely <= got, f"kept by transformers, never drawn: {sorted(surely - got)}"
        assert chi_square_ok(counts, probs)


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers(both_paths, dtype, penalty):
    """Seen tokens with positive, negative, zero and -inf logits (from the prompt and from the output) are
    penalised as `RepetitionPenaltyLogitsProcessor` does: divided when positive, multiplied otherwise."""
    row = special_row(300, 1, dtype)
    values = row.float()
    pick = lambda cond: torch.nonzero(cond).flatten()[:3].tolist()
    prompt = pick(values > 0) + pick(values == 0)[:1] + pick(values < 0)[:2]
    output = pick(torch.isneginf(values))[:1] + pick(values < 0)[2:3] + pick(values > 0)[:1]
    params = SamplingParams(repetition_penalty=penalty)
    batch = batch_of([params], prompts=[prompt], outputs=[output])
    want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([prompt + output]), values[None].clone())[0]
    assert not torch.equal(want, values)
    for got in both_paths(lambda: Sampler().modified(row[None], batch)):
        assert_same_logits(got[0], want.numpy())


@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.7])
def test_temperature_draws_follow_transformers_warper(both_paths, dtype, temperature):
    row = special_row(48, 2, dtype)
    check_draws(both_paths, row, SamplingParams(temperature=temperature),
                warped(row, TemperatureLogitsWarper(temperature)))


@pytest.mark.parametrize("top_k", [1, 2, 3, 4, 5, 6, 20])
def test_top_k_keeps_what_transformers_keeps_ties_included(both_paths, dtype, top_k):
    """k = 1 ends inside the two equal maxima (both kept); k = 4 and 5 inside the three equal 1.5s (all six kept)."""
    row = special_row(64, 3, dtype)
    check_draws(both_paths, row, SamplingParams(temperature=0.8, top_k=top_k),
                warped(row, TemperatureLogitsWarper(0.8), TopKLogitsWarper(top_k)))


def top_p_between_groups(row: torch.Tensor, temperature: float, groups: int) -> float:
    """A top-p that ends midway between two groups of equal logits (so no tie straddles the boundary): the mass
    of the best `groups` distinct values and a half of the next group."""
    probs = torch.softmax(row.double() / temperature, -1)
    values = torch.unique(row.float()[torch.isfinite(row.float())], sorted=True).flip(0)
    mass = [float(probs[row.float() == v].sum()) for v in values[:groups + 1]]
    return sum(mass[:groups]) - 0.5 * mass[groups] if groups else 0.5 * mass[0]


@pytest.mark.parametrize("groups", [1, 2, 4, 12])
def test_top_p_keeps_what_transformers_keeps(both_paths, dtype, groups):
    row = special_row(200, 4, dtype)
    top_p = top_p_between_groups(row, 0.9, groups)
    check_draws(both_paths, row, SamplingParams(temperature=0.9, top_p=top_p),
                warped(row, TemperatureLogitsWarper(0.9), TopPLogitsWarper(top_p)))


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9, 1.0])
def test_min_p_keeps_what_transformers_keeps(both_paths, dtype, min_p):
    """min_p = 1 keeps only the (tied) maxima."""
    row = special_row(64, 5, dtype)
    check_draws(both_paths, row, SamplingParams(temperature=1.1, min_p=min_p),
                warped(row, TemperatureLogitsWarper(1.1), MinPLogitsWarper(min_p)))


def test_top_k_ties_are_kept_in_a_large_vocabulary(both_paths, dtype):
    """A bf16-like row of a 5,000-token vocabulary where the k-th best value is shared by many tokens: every one of
    them stays a candidate, on the candidate path of both samplers."""
    g = np.random.default_rng(6)
    row = torch.from_numpy(np.round(g.normal(-1, 0.7, 5000) * 4) / 4).float()        # many exact ties, all < 3.5
    row[g.choice(5000, 9, replace=False)] = torch.tensor([4.0, 4.0, 3.75, 3.75, 3.75, 3.5, 3.5, 3.5, 3.5])
    row = row.to(dtype)
    check_draws(both_paths, row, SamplingParams(temperature=1.0, top_k=6),
                warped(row, TopKLogitsWarper(6)))
