"""The read bandwidth every benchmark measures, and the share of it a one-stream run of bench throughput reads:
the figure is sane, and the share comes from the model's byte count (weights as held, plus the KV)."""
import json
import math

import numpy as np
import pytest
import torch
from safetensors import safe_open

from nanovllm_tp.bench import bandwidth, throughput as bench
from nanovllm_tp.layers import cpu_kernels
from tests.helpers import GGUF, smollm2


def test_read_bandwidth_is_sane_and_reads_past_the_cache():
    figure = bandwidth.read_bandwidth(1)
    assert 0.1 < figure["gb_s"] < 1000 and figure["threads"] == 1 and figure["reads"] == bandwidth.READS
    if cpu_kernels.load() is not None:          # the C read, at its best stream count and prefetch
        assert figure["how"].startswith("csrc/read_rate.c")
        assert (figure["streams"], figure["ahead"]) in bandwidth.CONFIGS
    llc = bandwidth.last_level_cache_bytes()
    assert llc is None or llc > 0
    assert figure["buffer_bytes"] >= min(bandwidth.MAX_BYTES, bandwidth.CACHE_MULTIPLE * (llc or 0))
    assert bandwidth.read_bandwidth(1) is figure                 # once per thread count in a process


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler")
@pytest.mark.parametrize("threads, streams, ahead", [(1, 1, 0), (2, 4, 4096), (2, 8, 0), (3, 16, 64)])
def test_read_stream_reads_every_word(threads, streams, ahead):
    """The read rate's stream reads each word of every thread's share once (their XOR is the buffer's), however
    the shares are split into streams."""
    words = threads * streams * 32 * 5              # 256-byte steps: every part whole
    buf = torch.randint(-2**62, 2**62, (words,), dtype=torch.int64)
    expected = int(np.bitwise_xor.reduce(buf.numpy().view(np.uint64)))
    assert cpu_kernels.load().read_stream(buf, threads, streams, ahead) == expected
    buf[7] ^= 1 << 40
    assert cpu_kernels.load().read_stream(buf, threads, streams, ahead) == expected ^ (1 << 40)


def test_weight_bytes_are_the_checkpoints_tensors(tiny_model_dir):
    """The tiny checkpoint (tied): every tensor once, the embedding as the LM head, in the engine's dtype."""
    import glob
    total = 0
    for path in glob.glob(f"{tiny_model_dir}/*.safetensors"):
        with safe_open(path, "pt") as f:
            total += sum(math.prod(f.get_slice(n).get_shape()) for n in f.keys())
    assert bandwidth.weight_read_bytes(tiny_model_dir, torch.float32)["weights"] == 4 * total
    assert bandwidth.weight_read_bytes(tiny_model_dir, torch.bfloat16)["weights"] == 2 * total


@smollm2
def test_weight_bytes_of_a_quantized_file_are_its_blocks():
    held = bandwidth.weight_read_bytes(GGUF, torch.bfloat16, "Q4_1+Q8_0")["weights"]
    import os
    assert 0.9 < held / os.path.getsize(GGUF) <= 1.0            # the file is its blocks (and a header)
    assert bandwidth.weight_read_bytes(GGUF, torch.bfloat16)["weights"] > 2.5 * held      # dequantized to bf16


def test_share_arithmetic():
    s = bandwidth.decode_share(tok_s=10.0, weight_bytes=2_000_000_000, kv_bytes=500_000_000, bandwidth_gb_s=50.0)
    assert s["bytes_per_token"] == 2_500_000_000 and s["gb_s"] == pytest.approx(25.0)
    assert s["share"] == pytest.approx(0.5)


def test_one_stream_bench_reports_the_share_beside_its_figure(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "one.json"
    bench.main(["--model", tiny_model_dir, "--num-requests", "1", "--prompt-len", "8", "8", "--output-len", "9", "9",
                "--kv-cache-memory", str(32 << 20), "--threads", "1", "--out", str(out), "--quiet"])
    data = json.loads(out.read_text())
    env = data["environment"]["read_bandwidth"]
    assert 0.1 < env["gb_s"] < 1000 and env["threads"] == 1
    share = data["figures"]["engine"]["decode_share"]
    weights = bandwidth.weight_read_bytes(tiny_model_dir, torch.float32)["weights"]
    kv = bandwidth.kv_read_bytes(tiny_model_dir, torch.float32, "auto", 8 + (9 - 1) / 2)
    assert share["weight_bytes"] == weights and share["kv_bytes"] == kv > 0
    tok_s = data["figures"]["engine"]["tok_s"]
    assert share["gb_s"] == pytest.approx((weights + kv) * tok_s / 1e9)
    assert share["share"] == pytest.approx(share["gb_s"] / share["bandwidth_gb_s"])
    table = capsys.readouterr().out
    assert "GB/s read (of bandwidth)" in table and f"({share['share']:.0%})" in table
    bench.main(["--model", tiny_model_dir, "--num-requests", "2", "--prompt-len", "4", "4", "--output-len", "3", "3",
                "--kv-cache-memory", str(32 << 20), "--out", str(out), "--quiet"])
    assert "decode_share" not in json.loads(out.read_text())["figures"]["engine"]      # a batch: no share
