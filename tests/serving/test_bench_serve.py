"""bench_serve end to end: it launches our server, streams a tiny workload through it and through offline
generation, and writes the JSON with the right lengths; the server process is gone afterwards."""
import json

import pytest

from nanovllm_tp.config.engine_config import engine_argv
from nanovllm_tp.launch import serve_process

from nanovllm_tp.bench import serve as bench_serve
TINY = ["--num-requests", "4", "--prompt-len", "4", "8", "--output-len", "3", "6", "--kv-cache-memory", str(32 << 20)]


@pytest.mark.spawn
@pytest.mark.slow
def test_bench_serve_launch_with_offline_comparison(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "serve.json"
    result = bench_serve.main(["--launch", "--compare-offline", "--model", tiny_model_dir, *TINY,
                               "--concurrency", "4", "--request-rate", "inf", "--out", str(out), "--quiet"])
    assert capsys.readouterr().out.rstrip().splitlines()[-1].startswith("---")
    data = json.loads(out.read_text())
    assert data["workload"]["num_requests"] == 4 and "api_key" not in data["config"]
    assert data["config"]["base_url"].startswith("http://127.0.0.1:")
    (point,) = data["figures"]["points"]
    server, offline = point["server"], point["offline"]
    assert server["lengths_ok"] and offline["lengths_ok"]
    run = point["server_runs"][0]
    assert run["errors"] == 0
    assert [r["output_tokens"] for r in run["requests"]] == bench_serve.bc.make_workload(
        4, (4, 8), (3, 6), 0, 1).output_lens
    for m in ("ttft", "tpot", "itl", "e2e"):
        assert set(bench_serve.QUANTILES) <= server[m].keys()
    assert 0 < server["ttft"]["p50"] <= server["e2e"]["p50"]
    assert server["output_tok_s"] > 0 and server["request_throughput"] > 0 and offline["output_tok_s"] > 0
    assert point["server_over_offline_tok_s"] > 0 and point["tpot_p50_server_over_offline"] > 0
    assert result["out"] == str(out)


@pytest.mark.spawn
def test_bench_serve_streams_chats_one_at_a_time(tiny_model_dir, tmp_path, capsys):
    """--api chat: each text prompt as a user message to /v1/chat/completions; TPOT from the streamed deltas."""
    out = tmp_path / "chat.json"
    bench_serve.main(["--launch", "--api", "chat", "--dataset", "text", "--model", tiny_model_dir,
                      "--num-requests", "3", "--prompt-len", "4", "8", "--output-len", "16", "16",
                      "--kv-cache-memory", str(32 << 20), "--concurrency", "1", "--out", str(out), "--quiet"])
    (point,) = json.loads(out.read_text())["figures"]["points"]
    run = point["server_runs"][0]
    assert run["errors"] == 0 and point["server"]["lengths_ok"]
    # a loaded machine may hand a stream's tokens over in fewer chunks (merged deltas): TPOT 0 for one is possible
    assert all(r["tpot"] >= 0 and r["ttft"] > 0 for r in run["requests"]) and any(r["tpot"] > 0 for r in run["requests"])
    with pytest.raises(SystemExit, match="--dataset text"):
        bench_serve.main(["--launch", "--api", "chat", "--model", tiny_model_dir, "--num-requests", "1"])


def test_bench_serve_needs_a_url_or_launch():
    import pytest
    with pytest.raises(SystemExit):
        bench_serve.main(["--concurrency", "1"])
    with pytest.raises(SystemExit):
        bench_serve.main(["--base-url", "http://127.0.0.1:1/v1", "--compare-offline"])


@pytest.mark.spawn
@pytest.mark.slow
def test_bench_serve_against_a_running_server_with_text_prompts(tiny_model_dir, tmp_path, capsys):
    args = bench_serve.build_parser().parse_args(["--model", tiny_model_dir, "--api-key", "k",
                                                  "--kv-cache-memory", str(32 << 20)])
    proc, args.base_url = serve_process.start(engine_argv(args), args.api_key)
    try:
        out = tmp_path / "ext.json"
        bench_serve.main(["--base-url", args.base_url, "--api-key", "k", "--dataset", "text", *TINY[:8],
                          "--request-rate", "50", "--out", str(out), "--quiet"])
        ids = tmp_path / "ids.json"      # random token ids: --model DIR keeps them in its vocabulary
        bench_serve.main(["--base-url", args.base_url, "--api-key", "k", "--model", tiny_model_dir, *TINY[:8],
                          "--concurrency", "4", "--out", str(ids), "--quiet"])
        card = tmp_path / "card.json"    # no --model: the vocabulary of the directory the server names as its root
        bench_serve.main(["--base-url", args.base_url, "--api-key", "k", *TINY[:8], "--concurrency", "4",
                          "--out", str(card), "--quiet"])
    finally:
        serve_process.stop(proc)
    assert proc.returncode is not None
    assert json.loads(card.read_text())["workload"]["vocab_size"] == bench_serve.bc.model_vocab_size(tiny_model_dir)
    for path in (out, ids, card):
        (point,) = json.loads(path.read_text())["figures"]["points"]
        assert point["server"]["lengths_ok"] and point["server_runs"][0]["errors"] == 0 and "offline" not in point


@pytest.mark.spawn
@pytest.mark.slow
def test_bench_serve_compares_routers_of_replicas_on_shared_prefixes(tiny_model_dir, capsys):
    """Two replicas, one server per policy in turn on the same prompts: each prompt after one of two 64-token
    prefixes; the prefix cache's hit rate per point from the servers' counters, in the table too."""
    result = bench_serve.main(["--launch", "--model", tiny_model_dir, "--num-requests", "8", *TINY[2:],
                               "--data-parallel-size", "2", "--router", "prefix-aware", "round-robin",
                               "--dataset", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "64",
                               "--concurrency", "1", "--quiet"])
    points = result["figures"]["points"]
    assert [p["label"].split()[0] for p in points] == ["prefix-aware", "round-robin"]
    for p in points:
        assert p["server_runs"][0]["errors"] == 0 and p["server"]["lengths_ok"]
        assert 0 < p["server"]["prefix_hit_rate"] < 1
    # one at a time: prefix-aware sends each prefix to one replica, round-robin to both (each misses it once)
    assert points[0]["server"]["prefix_hit_rate"] > points[1]["server"]["prefix_hit_rate"]
    assert "prefix hit %" in capsys.readouterr().out
