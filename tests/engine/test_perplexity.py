"""launch/perplexity.py against transformers' own loss on the tiny checkpoint (fp32): the sliding window of
transformers' perplexity recipe (labels of the context masked, exp of the mean NLL weighted by scored tokens) and
llama-perplexity's chunking (disjoint chunks, each scoring its second half), computed here from the model's
loss; and the refusals of windows that cannot be made."""
import math

import pytest
import torch

from nanovllm_tp.launch.make_tiny import CORPUS
from nanovllm_tp.launch.perplexity import llama_cpp_windows, main, sliding_windows

TOKENS = 300


@pytest.fixture(scope="module")
def text_ids(tiny_model_dir):
    from transformers import AutoTokenizer
    text = CORPUS.read_text(encoding="utf-8")[:4000]
    ids = AutoTokenizer.from_pretrained(tiny_model_dir)(text)["input_ids"][:TOKENS]
    assert len(ids) == TOKENS
    return text, ids


def transformers_nll(model, ids: list[int], spans) -> tuple[float, int]:
    """Mean NLL and count over spans (start, end, scored from): transformers' loss with the context's labels
    masked, weighted by each span's scored tokens."""
    total, count = 0.0, 0
    for start, end, first in spans:
        window = torch.tensor([ids[start:end]])
        labels = window.clone()
        labels[:, :first] = -100
        with torch.no_grad():
            loss = model(window, labels=labels).loss.item()
        n = end - start - first
        total, count = total + loss * n, count + n
    return total / count, count


def run(tiny_model_dir, text, tmp_path, *flags):
    path = tmp_path / "text.txt"
    path.write_text(text, encoding="utf-8")
    return main(["--model", tiny_model_dir, "--text", str(path), "--dtype", "float32", "--max-tokens", str(TOKENS),
                 "--kv-cache-memory", str(32 << 20), *flags])


def test_sliding_window_is_transformers_recipe(tiny_model_dir, hf_model, text_ids, tmp_path):
    text, ids = text_ids
    spans, prev = [], 0
    for begin in range(0, TOKENS, 48):          # the recipe's loop: each window scores what is new in it
        end = min(begin + 128, TOKENS)
        spans.append((begin, end, max(1, prev - begin)))
        prev = end
        if end == TOKENS:
            break
    want, count = transformers_nll(hf_model, ids, spans)
    got = run(tiny_model_dir, text, tmp_path, "--ctx", "128", "--stride", "48")
    assert (got.scored, got.evaluated) == (count, sum(e - s for s, e, _ in spans)) and count == TOKENS - 1
    assert abs(got.nll - want) < 1e-4 and math.isclose(got.ppl, math.exp(want), rel_tol=1e-4)
    assert got.seconds > 0


def test_llama_cpp_chunks_score_their_second_half(tiny_model_dir, hf_model, text_ids, tmp_path):
    text, ids = text_ids
    want, count = transformers_nll(hf_model, ids, [(i * 100, i * 100 + 100, 51) for i in range(3)])
    got = run(tiny_model_dir, text, tmp_path, "--ctx", "100", "--llama-cpp")
    assert got.scored == count == 3 * 49 and abs(got.nll - want) < 1e-4


def test_windows_that_cannot_be_made_are_refused():
    assert [(w.start, w.end, w.scored) for w in sliding_windows(10, 4, 3)] == [(0, 4, 1), (3, 7, 1), (6, 10, 1)]
    assert [(w.start, w.end, w.scored) for w in sliding_windows(5, 4, 2)] == [(0, 4, 1), (2, 5, 2)]
    for bad in ((10, 1, 1), (10, 4, 0), (10, 4, 5), (1, 4, 2)):
        with pytest.raises(ValueError):
            sliding_windows(*bad)
    with pytest.raises(ValueError, match="at least 2 \\* ctx = 200 tokens, the text has 150"):
        llama_cpp_windows(150, 100)
