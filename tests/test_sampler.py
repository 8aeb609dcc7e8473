"""The sampler draws from softmax(logits / T), reproducibly per (seed, index)."""
import torch

from nanovllm_tp.layers.sampler import Sampler, uniform_noise


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    n = 20000
    rows = logits.repeat(n, 1)
    temps = torch.full((n,), 0.7)
    seeds = torch.arange(n, dtype=torch.int64) * 7919
    tokens = Sampler()(rows, temps, seeds, torch.zeros(n, dtype=torch.int64))
    freq = torch.bincount(tokens, minlength=5).float() / n
    want = torch.softmax(logits / 0.7, dim=-1)
    assert (freq - want).abs().max() < 0.015     # about 4 standard errors at n = 20000


def test_noise_is_a_function_of_seed_and_index_only():
    seeds = torch.tensor([1, 2, 1], dtype=torch.int64)
    index = torch.tensor([0, 0, 1], dtype=torch.int64)
    u = uniform_noise(seeds, index, 1000)
    assert ((u > 0) & (u < 1)).all()
    assert torch.equal(u[0], uniform_noise(seeds[:1], index[:1], 1000)[0])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(u.mean().item() - 0.5) < 0.02


def test_greedy_rows_take_argmax_and_tiny_temperatures_are_greedy():
    logits = torch.randn(4, 50)
    temps = torch.tensor([0.0, 1e-7, 1.0, 0.0])
    tokens = Sampler()(logits, temps, torch.arange(4), torch.zeros(4, dtype=torch.int64))
    assert tokens[[0, 1, 3]].tolist() == logits.argmax(-1)[[0, 1, 3]].tolist()


def test_argmax_rows_matches_torch_on_ties_and_slices():
    from nanovllm_tp.layers.sampler import argmax_rows
    torch.manual_seed(0)
    x = torch.randn(9, 2010)
    x[0, 5] = x[0, 700] = x[0, 2000] = 100.0       # a three-way tie: the first index wins
    x[1] = 0.0                                      # all equal
    x[2, 3] = float("-inf")
    sliced = x[:, :2003]                            # the LM head's padded-vocab slice: not contiguous
    got = argmax_rows(sliced)
    assert got.dtype == torch.int64
    assert torch.equal(got, sliced.argmax(dim=-1))
    assert got[0].item() == 5 and got[1].item() == 0
