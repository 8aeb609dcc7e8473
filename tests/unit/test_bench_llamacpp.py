"""bench --compare llamacpp without a llama.cpp build: the refusals (before anything loads), llama-server's slot and
context arithmetic, its command line, and the /completion request body and reply parser against the fields its
README documents."""
import os
import stat

import pytest
from nanovllm_tp.bench import throughput as bench, llamacpp as bench_llamacpp

TINY = ["--num-requests", "4", "--prompt-len", "4", "8", "--output-len", "4", "8"]


@pytest.fixture
def named_gguf(tmp_path):
    """A file with a GGUF's name and no GGUF inside: a refusal that reaches it must come before anything reads it."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"")
    return str(path)


def fake_bin(tmp_path, script: str) -> str:
    """A bin directory whose llama-server is the given shell script."""
    d = tmp_path / "bin"
    d.mkdir()
    exe = d / "llama-server"
    exe.write_text("#!/bin/sh\n" + script)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return str(d)


@pytest.mark.parametrize("model", ["/nonexistent/model", "model.safetensors", None])
def test_model_must_be_a_gguf_file(model, tmp_path):
    with pytest.raises(SystemExit, match="--compare llamacpp needs --model FILE.gguf"):
        bench.main(["--compare", "llamacpp", "--peer-bin", str(tmp_path), *TINY] + (["--model", model] if model else []))
    with pytest.raises(SystemExit, match="--model /nonexistent/model.gguf: no such file"):
        bench.main(["--compare", "llamacpp", "--model", "/nonexistent/model.gguf", "--peer-bin", str(tmp_path)])


def test_a_directory_is_refused_even_with_a_gguf_inside(tmp_path, named_gguf):
    with pytest.raises(SystemExit, match="needs --model FILE.gguf"):
        bench.main(["--compare", "llamacpp", "--model", str(tmp_path), "--peer-bin", str(tmp_path), *TINY])


def test_peer_bin_is_needed_and_must_hold_a_working_llama_server(tmp_path, named_gguf):
    with pytest.raises(SystemExit, match="needs --peer-bin DIR"):
        bench.main(["--compare", "llamacpp", "--model", named_gguf, *TINY])
    with pytest.raises(SystemExit, match=f"--peer-bin {tmp_path}: no executable llama-server"):
        bench.main(["--compare", "llamacpp", "--model", named_gguf, "--peer-bin", str(tmp_path), *TINY])
    broken = fake_bin(tmp_path, "echo 'error: something' >&2\nexit 3\n")
    with pytest.raises(SystemExit, match=r"llama-server --version failed \(status 3\)"):
        bench.main(["--compare", "llamacpp", "--model", named_gguf, "--peer-bin", broken, *TINY])


def test_version_line_is_read_from_stderr(tmp_path):
    d = fake_bin(tmp_path, "echo 'load_backend: loaded CPU backend' >&2\necho 'version: 11434 (abc123)' >&2\n")
    exe, version = bench_llamacpp.check_peer_bin(d)
    assert exe == os.path.join(d, "llama-server") and version == "11434 (abc123)"


def test_workload_longer_than_a_slot_is_refused(tmp_path, named_gguf):
    with pytest.raises(SystemExit, match="allow 16 tokens, above --max-model-len 12"):
        bench.main(["--compare", "llamacpp", "--model", named_gguf, "--peer-bin", str(tmp_path), *TINY,
                    "--max-model-len", "12"])


@pytest.mark.parametrize("requests, max_num_seqs, max_model_len, slots, ctx", [
    (32, 256, 1024, 32, 32 * 1024),      # every request at once
    (1, 256, 1024, 1, 1024),
    (300, 256, 512, 256, 256 * 512),     # as many at once as the engine runs
])
def test_slots_and_context(requests, max_num_seqs, max_model_len, slots, ctx):
    assert bench_llamacpp.server_shape(requests, max_num_seqs, max_model_len) == (slots, ctx)


def test_slots_and_context_refuse_zero():
    with pytest.raises(ValueError):
        bench_llamacpp.server_shape(0, 256, 1024)


def test_server_command_line():
    argv = bench_llamacpp.server_argv("/b/llama-server", "/m/f.gguf", 4321, 32, 32768, 1)

    def value(flag):
        return argv[argv.index(flag) + 1]

    assert argv[0] == "/b/llama-server" and value("-m") == "/m/f.gguf"
    assert value("--host") == "127.0.0.1" and value("--port") == "4321"
    assert value("-np") == "32" and value("-c") == "32768"
    assert value("-t") == "1" and value("-tb") == "1"
    assert value("--cache-ram") == "0" and "--no-webui" in argv
    assert "-kvu" not in argv and "--kv-unified" not in argv       # the context is split over the slots


def test_completion_body_uses_llama_servers_field_names():
    body = bench_llamacpp.completion_body([5, 6, 7], 9, 0.0, seed=3)
    assert body == {"prompt": [5, 6, 7], "n_predict": 9, "ignore_eos": True, "temperature": 0.0, "top_k": 1,
                    "top_p": 1.0, "min_p": 0.0, "seed": 3, "cache_prompt": False, "return_tokens": True,
                    "stream": False}
    sampled = bench_llamacpp.completion_body([5], 2, 0.8, seed=0)
    assert sampled["temperature"] == 0.8 and sampled["top_k"] == 0 and sampled["min_p"] == 0.0


@pytest.mark.parametrize("prompt, n", [([], 3), ([1, -1], 3), ([1, 2.0], 3), ([1], 0), ([1], 2.0), ("hi", 3)])
def test_completion_body_refuses_bad_requests(prompt, n):
    with pytest.raises(ValueError):
        bench_llamacpp.completion_body(prompt, n, 0.0, 0)


# the reply shape of llama-server's README (POST /completion, non-streamed, "return_tokens": true)
REPLY = {"index": 0, "content": " the the", "tokens": [264, 264, 11], "id_slot": 2, "stop": True,
         "model": "smollm2", "tokens_predicted": 3, "tokens_evaluated": 4, "generation_settings": {"n_predict": 3},
         "prompt": "", "has_new_line": False, "truncated": False, "stop_type": "limit", "stopping_word": "",
         "tokens_cached": 0, "timings": {"prompt_n": 4, "predicted_n": 3, "predicted_per_second": 80.1}}


def test_reply_parser_returns_the_generated_ids():
    assert bench_llamacpp.parse_completion(REPLY) == [264, 264, 11]


@pytest.mark.parametrize("reply, message", [
    ({"error": {"code": 400, "message": "the request exceeds the available context size", "type":
                "exceed_context_size_error"}}, "exceeds the available context size"),
    ({**REPLY, "tokens": None}, "without token ids"),
    ({k: v for k, v in REPLY.items() if k != "tokens"}, "without token ids"),
    ({**REPLY, "tokens": [1, "a"]}, "without token ids"),
    ({**REPLY, "truncated": True}, "truncated"),
    ([REPLY], "not a JSON object"),
])
def test_reply_parser_refuses_errors_and_replies_without_ids(reply, message):
    with pytest.raises(ValueError, match=message):
        bench_llamacpp.parse_completion(reply)
