"""generate()'s progress bar shows the prompt and decode rates so far (tokens over the seconds their steps took),
not one step's: checked on a real run of the tiny checkpoint against the steps as they ran, bar update by bar
update. A benchmark's progress lines and its results line, on a real run too."""
import io
import re

import pytest
from tqdm import tqdm

from nanovllm_tp import LLM, SamplingParams
from nanovllm_tp.bench import report
from nanovllm_tp.bench.progress import ProgressLines
from nanovllm_tp.entrypoints.step_rates import StepRates


def _rates(fields: dict) -> tuple[float, float]:
    return tuple(float(re.fullmatch(r"(\d+)tok/s", fields[k]).group(1)) for k in ("prefill", "decode"))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    engine = LLM(tiny_model_dir, kvcache_block_size=16, kv_cache_memory=16 << 20)
    yield engine
    engine.close()


def test_the_bar_shows_the_running_averages(llm):
    steps, shown = [], []
    real_step = llm._engine_step

    def timed_step():            # the real step, its tokens and time written down as the bar's loop sees them
        import time
        start = time.perf_counter()
        num_tokens, is_prefill = real_step()
        steps.append((num_tokens, is_prefill, time.perf_counter() - start))
        return num_tokens, is_prefill

    class Shown(tqdm):
        def set_postfix(self, ordered_dict=None, refresh=True, **fields):
            shown.append(dict(ordered_dict or {}, **fields))
            super().set_postfix(ordered_dict, refresh=refresh, **fields)

    llm._engine_step = timed_step
    try:
        prompts = ["The quick brown fox", "Return a list of", "Hello, world!"]
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (6, 14, 24)]
        outs = llm.generate(prompts, params, use_tqdm=lambda total, desc: Shown(total=total, desc=desc,
                                                                                 file=io.StringIO()))
    finally:
        del llm._engine_step
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 14, 24]
    assert len(shown) == len(steps) > 20
    expected = StepRates()
    for (num_tokens, is_prefill, seconds), fields in zip(steps, shown):
        expected.add(num_tokens, is_prefill, seconds)
        prefill, decode = _rates(fields)
        # the bar's clock reads a few microseconds apart from this one's, on steps of milliseconds
        assert prefill == pytest.approx(expected.prefill_rate, rel=0.05, abs=1)
        assert decode == pytest.approx(expected.decode_rate, rel=0.05, abs=1)
    decode_tokens = sum(n for n, prefill, _ in steps if not prefill)
    assert decode_tokens == 6 + 14 + 24 - 3          # each completion's first token came from its prefill
    assert _rates(shown[-1])[1] > 0          # the last step (rows finishing) leaves the average, not 0
    # the last step's own rate is not what the bar ends on: the average is over every decode step
    last_decode = next(s for s in reversed(steps) if not s[1] and s[0])
    assert expected.decode_tokens > last_decode[0]


def test_steps_without_tokens_count_for_neither():
    rates = StepRates()
    rates.add(0, False, 5.0)
    assert rates.decode_rate == 0.0 and rates.postfix() == {"prefill": "0tok/s", "decode": "0tok/s"}
    rates.add(100, True, 0.5)
    rates.add(4, False, 0.01)
    rates.add(4, False, 0.03)
    assert rates.prefill_rate == 200 and rates.decode_rate == pytest.approx(200)


def test_bench_progress_lines_on_a_real_run(llm, capsys):
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(["a", "b", "c", "d"], params,
                 use_tqdm=lambda total, desc: ProgressLines(total, desc, every=0.0, label="[1/1] engine"))
    lines = capsys.readouterr().err.splitlines()
    assert lines and all(re.fullmatch(r"\[1/1\] engine: \d/4 requests done, \d+ s, prefill \d+tok/s, "
                                      r"decode \d+tok/s", line) for line in lines), lines
    assert lines[-1].startswith("[1/1] engine: 4/4 requests done")


def test_a_bench_says_where_it_wrote(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)

    class Args:
        plot = None
        quiet = True

    out = report.default_out_path("bench")
    result = report.save_result(Args(), out, {"name": "bench"}, lambda result: None)
    err = capsys.readouterr().err
    assert err == f"results: {(tmp_path / out).resolve()}\n" and (tmp_path / result["out"]).is_file()
    assert out.parts[0] == "results"
