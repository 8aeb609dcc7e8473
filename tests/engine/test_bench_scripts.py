"""The benchmark scripts end to end on tiny settings: JSON fields, sane figures, the table printed last."""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from nanovllm_tp.bench import throughput as bench, common as bench_common, kv as bench_kv, latency as bench_latency, tp as bench_tp
from tests.helpers import GGUF, smollm2

TINY = ["--num-requests", "4", "--prompt-len", "4", "8", "--output-len", "4", "8"]
SMALL_KV = ["--kv-cache-memory", str(32 << 20)]
REPO = pathlib.Path(__file__).resolve().parents[2]


def last_block(text: str) -> list[str]:
    """The lines of the table at the end of stdout (title, rules, header, rows)."""
    lines = text.rstrip().splitlines()
    assert lines and set(lines[-1]) == {"-"}, f"stdout does not end with a table:\n{text}"
    return lines[-12:]


def check_environment(env: dict) -> None:
    for key in ("date", "python", "torch", "transformers", "cpu", "cpu_count", "torch_threads", "nanovllm_tp"):
        assert env.get(key) not in (None, ""), key
    assert env["torch_threads"] >= 1


def load(result: dict) -> dict:
    with open(result["out"]) as f:
        data = json.load(f)
    assert {"config", "environment", "figures", "workload"} <= data.keys()
    check_environment(data["environment"])
    return data


def test_workload_is_seeded_and_in_range():
    w = bench_common.make_workload(50, (4, 8), (3, 9), seed=7, vocab_size=100)
    again = bench_common.make_workload(50, (4, 8), (3, 9), seed=7, vocab_size=100)
    assert w.prompt_lens == again.prompt_lens and w.output_lens == again.output_lens
    assert w.prompts(1) == again.prompts(1) and w.prompts(1) != w.prompts(2)
    assert all(4 <= n <= 8 for n in w.prompt_lens) and all(3 <= n <= 9 for n in w.output_lens)
    assert [len(p) for p in w.prompts(3)] == w.prompt_lens
    assert all(0 <= t < 100 for p in w.prompts(0) for t in p)
    s = bench_common.summarize([1.0, 2.0, 3.0, 4.0])
    assert s["mean"] == 2.5 and s["p50"] == 2.5 and s["p90"] == pytest.approx(3.7) and s["p99"] <= 4.0


@pytest.mark.slow
@smollm2
def test_model_vocab_size_of_a_directory_and_of_a_gguf_file(tiny_model_dir):
    """The benchmarks' random prompts stay inside the vocabulary of --model, a HF directory or a .gguf file."""
    assert bench_common.model_vocab_size(tiny_model_dir) == json.load(open(os.path.join(tiny_model_dir, "config.json")))["vocab_size"]
    assert bench_common.model_vocab_size(GGUF) == 49152


def test_bench_with_hf_comparison(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    result = bench.main(["--model", tiny_model_dir, *TINY, *SMALL_KV, "--repeats", "2", "--compare", "hf",
                         "--hf-batch-sizes", "2", "4", "--out", str(out), "--quiet"])
    table = last_block(capsys.readouterr().out)
    data = load(result)
    f = data["figures"]
    engine = f["engine"]
    assert engine["tok_s"] > 0 and engine["seconds"] > 0 and len(engine["tok_s_runs"]) == 2
    assert engine["lengths_ok"]
    assert data["workload"]["num_requests"] == 4 and 4 <= data["workload"]["requested_output_tokens"] <= 32
    assert f["hf_generate"]["tok_s"] > 0 and f["hf_generate"]["batch_size"] in (2, 4)
    assert set(f["hf_generate"]["sweep"]) == {"2", "4"} and f["hf_generate"]["lengths_ok"]
    assert f["hf_continuous"]["tok_s"] > 0 and f["hf_continuous"]["lengths_ok"]
    for key in ("engine/hf_generate", "engine/hf_continuous"):
        assert f["ratios"][key] > 0 and math.isfinite(f["ratios"][key])
        assert f["ratios"][key] == pytest.approx(engine["tok_s"] / f[key.split("/")[1]]["tok_s"])
    text = "\n".join(table)
    assert "nanovllm_tp TP=1" in text and "hf generate" in text and "hf continuous batching" in text


def test_bench_kv_formats_side_by_side(tiny_model_dir, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog and keeps running through the field " * 8)
    result = bench_kv.main(["--model", tiny_model_dir, *TINY, *SMALL_KV, "--repeats", "2", "--kv-dtypes", "auto",
                            "int8", "--out", str(tmp_path / "kv.json"), "--quiet", "--ppl-text", str(text),
                            "--ppl-window", "64"])
    table = "\n".join(last_block(capsys.readouterr().out))
    f = load(result)["figures"]
    assert list(f) == ["auto", "int8"] and f["auto"]["ratio"] == 1.0 and f["auto"]["kv_cache"] == "float32"
    assert f["int8"]["ratio"] == pytest.approx(f["int8"]["tok_s"] / f["auto"]["tok_s"])
    pairs = sorted(a / b for a, b in zip(f["int8"]["tok_s_runs"], f["auto"]["tok_s_runs"]))
    assert f["auto"]["paired_ratio"] == 1.0 and f["int8"]["paired_ratio"] == pytest.approx(sum(pairs) / 2, rel=1e-6)
    assert all(0 < f[kv]["tpot_ms"] < 1e3 * f[kv]["seconds"] for kv in f)
    assert f["int8"]["kv_cache"] == "int8" and f["int8"]["lengths_ok"] and len(f["int8"]["tok_s_runs"]) == 2
    assert f["int8"]["num_kv_blocks"] > 3 * f["auto"]["num_kv_blocks"]      # 36 bytes a vector against 128
    assert f["auto"]["agreement"] == {"identical_requests": 4, "requests": 4, "prefix_share": 1.0}
    assert 0 <= f["int8"]["agreement"]["prefix_share"] <= 1
    assert "int8" in table and "paired ratio" in table and "TPOT ms" in table and "prefix share" in table and "perplexity" in table
    # a random model is a poor one: each near the vocabulary's size, and the two within a few percent
    assert 100 < f["auto"]["perplexity"] and f["int8"]["perplexity"] == pytest.approx(f["auto"]["perplexity"],
                                                                                      rel=0.05)


def test_bench_latency_closed_loop_and_plot(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "lat.json"
    result = bench_latency.main(["--model", tiny_model_dir, *TINY, *SMALL_KV, "--concurrency", "1", "3",
                                 "--out", str(out), "--plot", "--quiet"])
    captured = capsys.readouterr()
    table = last_block(captured.out)
    data = load(result)
    runs = data["figures"]["runs"]
    assert [r["concurrency"] for r in runs] == [1, 3] and all(r["mode"] == "closed" for r in runs)
    for run in runs:
        assert run["lengths_ok"] and run["output_tok_s"] > 0 and run["request_throughput"] > 0
        assert len(run["requests"]) == 4
        for key in ("ttft", "tpot", "e2e"):
            s = run[key]
            assert s["count"] == 4 and 0 < s["p50"] <= s["p90"] <= s["p99"] and s["mean"] > 0
        for r in run["requests"]:
            assert r["e2e"] >= r["ttft"] > 0
    assert any("concurrency 3" in line for line in table)
    try:
        import matplotlib  # noqa: F401
        assert (tmp_path / "lat.png").stat().st_size > 0 and data["plot"].endswith("lat.png")
    except ImportError:
        assert "matplotlib is not installed" in captured.err and "plot" not in data


def test_bench_latency_poisson(tiny_model_dir, tmp_path, capsys):
    result = bench_latency.main(["--model", tiny_model_dir, *TINY, *SMALL_KV, "--request-rate", "200",
                                 "--out", str(tmp_path / "lat.json"), "--quiet"])
    last_block(capsys.readouterr().out)
    run, = load(result)["figures"]["runs"]
    assert run["mode"] == "poisson" and run["request_rate"] == 200 and run["lengths_ok"]
    arrivals = [r["arrival"] for r in run["requests"]]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals)
    assert run["ttft"]["p50"] > 0 and run["tpot"]["p99"] > 0 and run["queue_delay"]["min"] >= 0


@pytest.mark.spawn
@pytest.mark.slow
def test_bench_tp_scaling(tiny_model_dir, tmp_path, capfd):
    result = bench_tp.main(["--tp-list", "1", "2", "--model", tiny_model_dir, *TINY, *SMALL_KV,
                            "--out", str(tmp_path / "tp.json"), "--quiet"])
    table = last_block(capfd.readouterr().out)
    data = load(result)
    f = data["figures"]
    assert [r["tp"] for r in f["runs"]] == [1, 2] and all(r["tok_s"] > 0 and r["lengths_ok"] for r in f["runs"])
    assert f["scaling"]["1"] == 1.0 and f["scaling"]["2"] > 0
    assert f["scaling"]["2"] == pytest.approx(f["runs"][1]["tok_s"] / f["runs"][0]["tok_s"])
    assert all(r["child_environment"]["OMP_NUM_THREADS"] == "1" for r in f["runs"])
    assert any(line.startswith("TP=2") for line in table)


@pytest.mark.spawn
def test_bench_tp_pipeline_layouts(tiny_model_dir, tmp_path, capfd):
    """--pp-list with --micro-batches: TP=1, then PP=2 with one step in flight and with two, figures keyed by
    layout, ordered by ranks; --trace: how much of steady decode the stages computed at once. With one step in
    flight they never do; with two, two steps were in flight, and whether the stages then overlapped in time depends
    on the machine's load (a figure for the benchmark, not an assertion here)."""
    result = bench_tp.main(["--tp-list", "1", "--pp-list", "1", "2", "--micro-batches", "1", "2", "--model",
                            tiny_model_dir, *TINY, *SMALL_KV, "--trace", str(tmp_path / "t.json"),
                            "--out", str(tmp_path / "pp.json"), "--quiet"])
    table = last_block(capfd.readouterr().out)
    f = load(result)["figures"]
    assert [(r["tp"], r["pp"], r["micro_batches"], r["ranks"]) for r in f["runs"]] == \
        [(1, 1, None, 1), (1, 2, 1, 2), (1, 2, 2, 2)]
    assert all(r["tok_s"] > 0 and r["lengths_ok"] for r in f["runs"])
    assert "pipeline stage 0/2" in f["runs"][1]["runner"] and "pipeline" not in f["runs"][0]["runner"]
    assert f["scaling"]["1x2/mb2"] == pytest.approx(f["runs"][2]["tok_s"] / f["runs"][0]["tok_s"])
    assert f["efficiency"]["1x2/mb1"] == pytest.approx(f["scaling"]["1x2/mb1"] / 2)
    one, two = f["runs"][1]["stage_overlap"], f["runs"][2]["stage_overlap"]
    assert f["runs"][0]["stage_overlap"] is None and set(one["busy"]) == {"0", "1"}
    assert [r["max_steps_in_flight"] for r in f["runs"]] == [1, 1, 2]
    assert one["all_busy"] == 0 <= two["all_busy"] <= min(two["busy"].values())
    assert any(line.startswith("TP=1xPP=2 mb=2") for line in table)


@pytest.mark.spawn
@pytest.mark.slow
def test_bench_latency_under_torchrun(tiny_model_dir, tmp_path):
    """`./torchrun.sh 2 -m nanovllm_tp.bench.latency --tp 2`: rank 1 serves, rank 0 measures and prints."""
    out = tmp_path / "tr.json"
    proc = subprocess.run(["./torchrun.sh", "2", "-m", "nanovllm_tp.bench.latency", "--tp", "2",
                           "--model", tiny_model_dir, *TINY, *SMALL_KV, "--no-warmup", "--concurrency", "2",
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          check=False, env=dict(os.environ, PYTHON=sys.executable))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "concurrency 2" in "\n".join(last_block(proc.stdout))
    data = json.loads(out.read_text())
    assert data["environment"]["launched_by"] == "torchrun" and data["config"]["tensor_parallel_size"] == 2
    assert data["figures"]["runs"][0]["lengths_ok"]


@pytest.mark.spawn
@pytest.mark.slow
def test_broadcast_latency_micro_benchmark_runs_and_cleans_up():
    import os

    from nanovllm_tp.distributed.channel_bench import measure_broadcast_latency
    before = {n for n in os.listdir("/dev/shm") if n.startswith(f"nvtp_bench_{os.getpid()}_")}
    result = measure_broadcast_latency(payload_bytes=20_000, readers=2, iterations=50, warmup=10)
    assert result["readers"] == 2 and result["iterations"] == 50
    assert 0 < result["median_us"] <= result["p99_us"]
    after = {n for n in os.listdir("/dev/shm") if n.startswith(f"nvtp_bench_{os.getpid()}_")}
    assert after == before


@pytest.mark.parametrize("threads", ["0", "-2"])
def test_thread_counts_below_one_are_refused(threads):
    with pytest.raises(SystemExit, match="--threads must be >= 1"):
        bench.main([*TINY, "--threads", threads, "--quiet"])


@pytest.mark.slow
def test_bench_embed_against_transformers(tiny_model_dir, tmp_path, capsys):
    from nanovllm_tp.bench import embed as bench_embed
    result = bench_embed.main(["--model", tiny_model_dir, *SMALL_KV, "--batch", "4", "--prompt-tokens", "16",
                               "--repeats", "2", "--out", str(tmp_path / "embed.json"), "--quiet"])
    table = "\n".join(last_block(capsys.readouterr().out))
    f = result["figures"]
    assert f["engine_emb_s"] > 0 and f["transformers_emb_s"] > 0 and f["ratio"] > 0
    assert f["min_cosine"] >= 0.9999          # fp32, the same weights: the same embeddings
    assert "engine/transformers" in table and len(result["runs"]["engine"]) == 2
    with open(result["out"]) as fh:
        check_environment(json.load(fh)["environment"])


def test_prompt_attention_bench_times_both_and_they_agree(tmp_path, capsys):
    """bench prompt-attention: SDPA and the C kernel's decode rows on the same prompts, timed, and their outputs
    within bf16's rounding of each other (the lengths cross a block edge)."""
    from nanovllm_tp.bench import prompt_attention
    from nanovllm_tp.layers import cpu_kernels
    if cpu_kernels.load() is None:
        pytest.skip("the C kernels do not build here")
    out = tmp_path / "prompt.json"
    result = prompt_attention.main(["--lengths", "20", "70", "--repeats", "1", "--quiet", "--out", str(out)])
    assert set(result["figures"]) == {20, 70} and out.exists()
    for f in result["figures"].values():
        assert f["sdpa_ms"] > 0 and f["kernel_ms"] > 0 and f["max_abs_diff"] < 0.05
    assert "SDPA / kernel" in capsys.readouterr().out
