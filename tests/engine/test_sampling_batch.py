"""Per-request sampling in a shared batch, through the public API: a row's tokens depend on its own
SamplingParams only, whatever its neighbours ask for, and sampled frequencies follow softmax(logits / T)
of transformers' logits at each row's own temperature."""
import collections

import pytest
import torch

from nanovllm_tp import LLM, SamplingParams
from tests.helpers import hf_greedy

PROMPTS = [[5, 17, 99, 4], [1, 2, 3], [300, 301, 302, 303, 304, 305, 306, 307, 308], [42] * 20, [7, 8],
           [1000, 20, 1500]]
# greedy rows between sampled rows of different temperatures and seeds: each row's temperature must be its own
PARAMS = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=1.3, seed=11, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0.6, seed=12, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=2.0, seed=13, max_tokens=8, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]


def completions(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_each_row_as_if_alone(llm, hf_model):
    batched = completions(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    alone = [completions(llm.generate([p], [sp], use_tqdm=False))[0] for p, sp in zip(PROMPTS, PARAMS)]
    assert batched == alone
    for p, sp, got in zip(PROMPTS, PARAMS, batched):
        if sp.temperature == 0:
            assert got == hf_greedy(hf_model, p, sp.max_tokens)
    hot = [got for sp, got in zip(PARAMS, batched) if sp.temperature > 0]
    assert any(got != hf_greedy(hf_model, p, 8) for p, got in zip(
        [p for p, sp in zip(PROMPTS, PARAMS) if sp.temperature > 0], hot)), "sampled rows never left greedy"


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=(pytest.mark.spawn, pytest.mark.slow))], ids=["tp1", "tp2"])
def test_mixed_batch_rows_equal_alone(tiny_model_dir, hf_model, tp):
    llm = LLM(tiny_model_dir, tensor_parallel_size=tp, kvcache_block_size=16, kv_cache_memory=16 << 20)
    try:
        assert_each_row_as_if_alone(llm, hf_model)
    finally:
        llm.close()


def test_sampled_frequencies_follow_each_rows_temperature(tiny_llm, hf_model):
    prompt, n, top = [5, 17, 99, 4], 800, 4
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, -1]
    # one batch: greedy, T=0.7, greedy, T=2.0, ... (a greedy row next to every sampled one)
    temps = [0.0, 0.7, 0.0, 2.0] * n
    params = [SamplingParams(temperature=t, seed=1000 + i, max_tokens=1, ignore_eos=True)
              for i, t in enumerate(temps)]
    got = [o.outputs[0].token_ids[0] for o in tiny_llm.generate([prompt] * len(temps), params, use_tqdm=False)]
    by_temp = collections.defaultdict(list)
    for t, token in zip(temps, got):
        by_temp[t].append(token)
    assert set(by_temp[0.0]) == {int(logits.argmax())}
    for t in (0.7, 2.0):
        want = torch.softmax(logits / t, dim=-1)
        ids = want.argsort(descending=True)[:top].tolist()
        counts = collections.Counter(by_temp[t])
        freq = [counts[i] / len(by_temp[t]) for i in ids]
        expected = [float(want[i]) for i in ids]
        # standard error <= 0.5 / sqrt(2 * n) = 0.0125 per bin: 0.05 is four of them
        assert max(abs(f - e) for f, e in zip(freq, expected)) < 0.05, (t, freq, expected)
        rest = 1 - sum(freq)
        assert abs(rest - (1 - sum(expected))) < 0.05, (t, rest)
