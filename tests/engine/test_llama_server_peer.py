"""bench --compare llamacpp against a real llama-server (NANOVLLM_TP_TEST_LLAMA_SERVER names the binary; skipped
without one, as on CI): on a tiny fp32 GGUF, llama-server's greedy tokens for our token-id prompts are
transformers' on the same file, it is stopped except while it answers, and nothing is left once it is closed."""
import json
import os
import pathlib

import pytest
from nanovllm_tp import envs
from nanovllm_tp.bench import throughput as bench, common as bench_common, llamacpp as bench_llamacpp
from tests.helpers import hf_greedy
from tests.procs import alive
from tests.unit.test_bench_peer import children, stopped

SERVER = envs.get("NANOVLLM_TP_TEST_LLAMA_SERVER")
pytestmark = [pytest.mark.spawn,
              pytest.mark.skipif(not SERVER, reason="NANOVLLM_TP_TEST_LLAMA_SERVER (a llama-server binary) not set")]


@pytest.fixture(scope="module")
def fp32_gguf(tmp_path_factory, tiny_model_dir):
    """A tiny Llama GGUF with fp32 tensors, and transformers reading that file."""
    import torch
    from transformers import AutoModelForCausalLM
    from nanovllm_tp.launch.make_tiny import make_tiny_arch
    from tests.gguf_tiny import write_gguf
    out = tmp_path_factory.mktemp("gguf-f32")
    path = write_gguf(make_tiny_arch(out / "hf", "llama"), pathlib.Path(tiny_model_dir), out / "tiny.gguf",
                      qtype="F32", embed_qtype="F32")
    hf = AutoModelForCausalLM.from_pretrained(str(out), gguf_file="tiny.gguf", dtype=torch.float32)
    return str(path), hf.eval()


def test_llama_server_greedy_equals_transformers_and_leaves_nothing(fp32_gguf):
    path, hf = fp32_gguf
    w = bench_common.make_workload(4, (3, 12), (2, 9), seed=5, vocab_size=hf.config.vocab_size)
    already = set(children())
    slots, ctx = bench_llamacpp.server_shape(w.num_requests, 256, 64)
    server = bench_llamacpp.LlamaServer(SERVER, path, slots, ctx, 1, 120, [1, 2, 3])
    try:
        assert server.ready["slots"] == 4 and server.ready["first_token_s"] >= server.ready["load_s"] > 0
        assert stopped(server.proc.pid)
        for draw in (1, 2):           # the second draw runs on slots the first one used: no KV carried over
            prompts = w.prompts(draw)
            reply = server.run(prompts, w.output_lens, 0.0)
            assert stopped(server.proc.pid)
            assert reply["seconds"] > 0
            assert reply["token_ids"] == [hf_greedy(hf, p, n) for p, n in zip(prompts, w.output_lens)]
    finally:
        server.close()
    assert not alive(server.proc.pid) and not [p for p in children() if alive(p) and p not in already]


def test_bench_compare_llamacpp_end_to_end(fp32_gguf, tmp_path, capsys):
    path, _ = fp32_gguf
    out = tmp_path / "bench.json"
    already = set(children())
    bench.main(["--model", path, "--compare", "llamacpp", "--peer-bin", os.path.dirname(SERVER),
                "--num-requests", "3", "--prompt-len", "4", "8", "--output-len", "3", "6", "--max-model-len", "128",
                "--kv-cache-memory", str(32 << 20), "--threads", "1", "--repeats", "2", "--out", str(out), "--quiet"])
    table = capsys.readouterr().out.rstrip().splitlines()
    assert table[-2].startswith("llama.cpp ") and table[-3].startswith("nanovllm_tp ")
    data = json.loads(out.read_text())
    f = data["figures"]
    peer, engine = f["llamacpp"], f["engine"]
    assert engine["lengths_ok"] and peer["lengths_ok"] and len(peer["tok_s_runs"]) == 2
    assert peer["tok_s"] > 0 and peer["slots"] == 3 and peer["ctx_size"] == 3 * 128 and peer["threads"] == 1
    assert peer["agreement"]["requests"] == 6 and peer["agreement"]["identical"] >= 5       # fp32 both
    assert peer["ratio"]["of_medians"] == pytest.approx(engine["tok_s"] / peer["tok_s"])
    assert data["environment"]["llama_cpp"] and peer["argv"][0] == SERVER
    assert not [p for p in children() if alive(p) and p not in already]


def test_a_file_llama_server_cannot_load_is_reported_with_its_log(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    already = set(children())
    with pytest.raises(SystemExit, match="(?s)llama-server exited with .* before it was ready.*its last log lines"):
        bench_llamacpp.LlamaServer(SERVER, str(bad), 1, 128, 1, 120, [1, 2, 3])
    assert not [p for p in children() if alive(p) and p not in already]
