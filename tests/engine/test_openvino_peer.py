"""bench --compare openvino: OpenVINO GenAI from its own virtualenv (NANOVLLM_TP_OPENVINO_PYTHON names its python).
Without it: the config's checks, the export's command line, the refusals before anything loads. With it (skipped
otherwise, as on CI): the peer end to end on the tiny checkpoint in fp32, greedy tokens equal to transformers',
stopped except while it answers, nothing left behind, and the comparison's JSON and table."""
import argparse
import json
import sys

import pytest

from nanovllm_tp import envs
from nanovllm_tp.bench import common as bench_common, openvino_compare as ov, openvino_peer, throughput as bench
from tests.helpers import GGUF, hf_greedy, smollm2
from tests.procs import alive
from tests.unit.test_bench_peer import children, stopped

PYTHON = envs.get("NANOVLLM_TP_OPENVINO_PYTHON")
openvino = pytest.mark.skipif(not PYTHON, reason="NANOVLLM_TP_OPENVINO_PYTHON (the python of a virtualenv with "
                              "openvino-genai) not set")
CONFIG = {"op": "config", "model": "/tmp/ov", "precision": "f32", "kv_precision": "f32", "threads": 1,
          "max_num_seqs": 8, "max_num_batched_tokens": 512, "cache_gib": 1, "prefix_caching": False,
          "cold_prompt": [1, 2, 3]}


def test_config_checks_and_properties():
    msg = openvino_peer.decode_config(json.dumps(CONFIG))
    assert openvino_peer.properties(msg) == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                             "INFERENCE_NUM_THREADS": 1}
    for bad, error in (({"precision": "fp16"}, ValueError), ({"threads": 0}, ValueError),
                       ({"prefix_caching": 0}, TypeError), ({"cold_prompt": []}, ValueError)):
        with pytest.raises(error):
            openvino_peer.decode_config(json.dumps({**CONFIG, **bad}))


def test_export_command_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576, "intermediate_size": 1536}))
    argv = ov.export_argv("/venv/bin/python", str(tmp_path), "int4", "/out")
    assert argv[:8] == ["/venv/bin/optimum-cli", "export", "openvino", "--model", str(tmp_path), "--task",
                        "text-generation-with-past", "--weight-format"]
    assert argv[8:] == ["int4", "--group-size", "64", "/out"]           # 576 is not a multiple of 128
    assert "--group-size" not in ov.export_argv("/venv/bin/python", str(tmp_path), "int8", "/out")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 2048, "intermediate_size": 8192}))
    assert "--group-size" not in ov.export_argv("/venv/bin/python", str(tmp_path), "int4", "/out")
    with pytest.raises(ValueError, match="weight format"):
        ov.export_argv("/venv/bin/python", str(tmp_path), "nf4", "/out")


def test_refusals_before_anything_loads(monkeypatch, tmp_path):
    monkeypatch.delenv("NANOVLLM_TP_OPENVINO_PYTHON", raising=False)
    with pytest.raises(SystemExit, match="needs --peer-python PATH or NANOVLLM_TP_OPENVINO_PYTHON"):
        bench.main(["--compare", "openvino", "--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="no such executable file"):
        bench.main(["--compare", "openvino", "--peer-python", "/nonexistent/python", "--model", str(tmp_path)])
    with pytest.raises(SystemExit, match="cannot import openvino_genai"):       # this interpreter has none
        bench.main(["--compare", "openvino", "--peer-python", sys.executable, "--model", str(tmp_path)])


@smollm2
def test_peer_model_is_the_directory_exported_and_must_be_the_engines_shape(tiny_model_dir):
    """--peer-model names the HF directory OpenVINO exports while the engine runs --model (a GGUF file of the same
    model): without it a GGUF --model is refused; a --peer-model of another shape is refused naming the facts
    that differ; one of the same shape is what gets exported."""
    def args(model, peer_model=None):
        return argparse.Namespace(model=model, peer_model=peer_model)

    assert ov.peer_source(args(tiny_model_dir)) == tiny_model_dir
    with pytest.raises(ValueError, match="needs --model to be a Hugging Face directory"):
        ov.peer_source(args(GGUF))
    with pytest.raises(ValueError, match=r"not --model's shape: vocab_size 49152 against \d+; hidden_size 576"):
        ov.peer_source(args(GGUF, tiny_model_dir))
    with pytest.raises(ValueError, match="needs --peer-model to be a Hugging Face directory"):
        ov.peer_source(args(tiny_model_dir, GGUF))
    assert ov.peer_source(args(tiny_model_dir, tiny_model_dir)) == tiny_model_dir


@pytest.fixture(scope="module")
def exported_tiny(tiny_model_dir):
    """The tiny checkpoint exported once (fp32 weights), kept in the cache as bench keeps it."""
    return ov.exported(PYTHON, tiny_model_dir, "fp32", ov.check_peer_python(PYTHON), timeout=1800)


@pytest.mark.spawn
@openvino
def test_openvino_greedy_equals_transformers_and_leaves_nothing(exported_tiny, hf_model):
    w = bench_common.make_workload(4, (3, 12), (2, 9), seed=5, vocab_size=hf_model.config.vocab_size)
    already = set(children())
    config = {k: v for k, v in CONFIG.items() if k != "op"} | {"model": str(exported_tiny)}
    peer = ov.PeerProcess(PYTHON, config, {}, 600, ov.PEER_SCRIPT, "OpenVINO GenAI")
    try:
        assert peer.ready["properties"]["INFERENCE_PRECISION_HINT"] == "f32" and peer.ready["first_token_s"] > 0
        assert stopped(peer.proc.pid)
        prompts = w.prompts(1)
        reply = peer.run(prompts, w.output_lens, 0.0)
        assert stopped(peer.proc.pid)
        assert reply["token_ids"] == [hf_greedy(hf_model, p, n) for p, n in zip(prompts, w.output_lens)]
    finally:
        peer.close()
    assert not alive(peer.proc.pid) and not [p for p in children() if alive(p) and p not in already]


@pytest.mark.spawn
@openvino
def test_bench_compare_openvino_end_to_end(exported_tiny, tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench.main(["--model", tiny_model_dir, "--dtype", "float32", "--compare", "openvino", "--num-requests", "3",
                "--prompt-len", "4", "8", "--output-len", "3", "6", "--max-model-len", "128",
                "--kv-cache-memory", str(32 << 20), "--threads", "1", "--repeats", "2", "--out", str(out), "--quiet"])
    data = json.loads(out.read_text())
    peer = data["figures"]["openvino"]
    assert peer["tok_s"] > 0 and peer["lengths_ok"] and peer["weight_format"] == "fp32"
    assert peer["agreement"]["identical"] == peer["agreement"]["requests"] == 6
    assert peer["properties"] == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                  "INFERENCE_NUM_THREADS": 1}
    assert data["environment"]["openvino_genai"]
    assert "OpenVINO GenAI fp32" in capsys.readouterr().out
