"""bench --compare vllm without vLLM here: the peer protocol, the comparison arithmetic, and the refusals."""
import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
from nanovllm_tp.bench import throughput as bench, common as bench_common, compare as bench_compare, peer as bench_peer, vllm as bench_vllm
from tests.procs import alive

HAS_VLLM = importlib.util.find_spec("vllm") is not None
CONFIG = {"op": "config", "model": "/tmp/m", "dtype": "float32", "max_model_len": 1024, "enforce_eager": True,
          "max_num_seqs": 256, "max_num_batched_tokens": 8192, "seed": 0, "cold_prompt": [1, 2, 3]}


def test_workload_round_trips_through_json_lines():
    w = bench_common.make_workload(5, (3, 9), (2, 7), seed=3, vocab_size=500)
    prompts = w.prompts(draw=1)
    line = bench_peer.encode(bench_peer.run_message(prompts, w.output_lens, 0))
    assert "\n" not in line
    msg = bench_peer.decode_command(line)
    assert msg["prompts"] == prompts and msg["max_tokens"] == w.output_lens and msg["temperature"] == 0.0
    assert bench_peer.decode_config(bench_peer.encode(CONFIG)) == CONFIG
    assert bench_peer.decode_command(bench_peer.encode({"op": "quit"})) == {"op": "quit"}


@pytest.mark.parametrize("bad, error", [
    ({"prompts": [[1, -2]], "max_tokens": [3]}, ValueError),
    ({"prompts": [[1, 2]], "max_tokens": [3, 4]}, ValueError),
    ({"prompts": [[1, 2.0]], "max_tokens": [3]}, ValueError),
    ({"prompts": [], "max_tokens": []}, ValueError),
    ({"prompts": [[1]], "max_tokens": [0]}, ValueError),
    ({"prompts": [[1]], "max_tokens": [1], "temperature": -1}, ValueError),
    ({"prompts": [[1]], "max_tokens": [1], "ignore_eos": "yes"}, ValueError),
])
def test_bad_run_messages_are_refused(bad, error):
    with pytest.raises(error):
        bench_peer.decode_command(json.dumps({"op": "run", "temperature": 0, **bad}))


def test_bad_config_is_refused():
    with pytest.raises(TypeError, match="max_model_len"):
        bench_peer.decode_config(json.dumps({**CONFIG, "max_model_len": "1024"}))
    with pytest.raises(TypeError, match="enforce_eager"):
        bench_peer.decode_config(json.dumps({**CONFIG, "enforce_eager": 1}))
    with pytest.raises(ValueError, match="first line"):
        bench_peer.decode_config(json.dumps({"op": "run"}))


def test_agreement_counts_identical_requests_and_common_prefixes():
    ours = [[5, 6, 7, 8], [1, 2, 3], [9, 9], [4]]
    peer = [[5, 6, 7, 8], [1, 2, 4], [8, 9], [4]]
    a = bench_compare.agreement(ours, peer)
    assert a == {"requests": 4, "identical": 2, "tokens": 10, "tokens_before_first_difference": 4 + 2 + 0 + 1}
    b = bench_compare.agreement([[1, 2]], [[1, 2, 3]])         # a shorter output is not identical
    assert b["identical"] == 0 and b["tokens_before_first_difference"] == 2
    assert bench_compare.merge_agreement([a, b]) == {"requests": 5, "identical": 2, "tokens": 12,
                                                  "tokens_before_first_difference": 9}
    with pytest.raises(ValueError):
        bench_compare.agreement([[1]], [])


def test_ratios_and_throughput_from_real_runs():
    w = bench_common.make_workload(3, (4, 4), (2, 6), seed=1, vocab_size=100)
    tokens = [[7] * n for n in w.output_lens]
    ours = [bench_compare.timed(s, w, tokens) for s in (1.0, 2.0, 4.0)]
    peer = [bench_compare.timed(s, w, tokens) for s in (2.0, 2.0, 2.0)]
    assert all(r["lengths_ok"] for r in ours) and ours[0]["tok_s"] == w.requested_output_tokens
    assert not bench_compare.timed(1.0, w, tokens[:-1] + [[7]])["lengths_ok"]     # outputs are >= 2 tokens
    r = bench_compare.ratios(ours, peer)
    assert r["repeats"] == [2.0, 1.0, 0.5] and r["median_of_repeats"] == 1.0 and r["of_medians"] == 1.0
    r = bench_compare.ratios(ours[:2], peer[:2])
    assert r["of_medians"] == pytest.approx((1 / 1.0 + 1 / 2.0) / 2 / (1 / 2.0))


@pytest.mark.spawn
def test_missing_peer_python_fails_before_loading_anything():
    out = subprocess.run([sys.executable, "-m", "nanovllm_tp.bench.throughput", "--compare", "vllm", "--peer-python",
                          "/nonexistent", "--model", "/nonexistent/model"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0
    assert "--peer-python /nonexistent: no such executable file" in out.stderr
    assert "Traceback" not in out.stderr
    with pytest.raises(SystemExit, match="needs --peer-python"):
        bench.main(["--compare", "vllm", "--model", "/nonexistent/model"])


@pytest.mark.spawn
@pytest.mark.slow
@pytest.mark.skipif(HAS_VLLM, reason="checks the refusal of an interpreter without vLLM")
def test_peer_python_without_vllm_is_refused_and_leaves_nothing():
    already = set(children())           # e.g. a resource tracker an earlier test of this session started
    with pytest.raises(SystemExit, match="cannot import vllm"):
        bench.main(["--compare", "vllm", "--peer-python", sys.executable, "--model", "/nonexistent/model"])
    # the driver itself under that interpreter: the failure comes back as a protocol line, the process is gone
    with pytest.raises(RuntimeError, match="vLLM peer: ModuleNotFoundError.*vllm") as info:
        bench_vllm.PeerProcess(sys.executable, {k: v for k, v in CONFIG.items() if k != "op"}, {}, timeout=120)
    assert "no module named" in str(info.value).lower()
    assert not [p for p in children() if alive(p) and p not in already]


def children() -> list[int]:
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    out.append(int(d))
        except OSError:
            pass
    return out



STAND_IN_VLLM = '''
__version__ = "0.0-stand-in"
class SamplingParams:
    def __init__(self, max_tokens, **kw): self.max_tokens = max_tokens
class _Completion:
    def __init__(self, ids): self.token_ids = ids
class _Output:
    def __init__(self, ids): self.outputs = [_Completion(ids)]
class LLM:
    def __init__(self, **kw): pass
    def generate(self, prompts, params, use_tqdm=False):
        return [_Output([p["prompt_token_ids"][0]] * s.max_tokens) for p, s in zip(prompts, params)]
'''


def stopped(pid: int) -> bool:
    """Whether the process is stopped, once a signal sent just before has had time to land."""
    deadline = time.monotonic() + 5
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


@pytest.mark.spawn
def test_the_peer_is_stopped_except_while_it_answers(tmp_path):
    """Idle vLLM processes poll; the driver keeps the peer's process group stopped between its runs, so it takes
    no CPU from the engine being timed, and close() still ends it (driven here through a stand-in `vllm`)."""
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text(STAND_IN_VLLM)
    (tmp_path / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids): return {'prompt_token_ids': "
                                                 "prompt_token_ids}\n")
    env = {"PYTHONPATH": str(tmp_path)}
    peer = bench_vllm.PeerProcess(sys.executable, {k: v for k, v in CONFIG.items() if k != "op"}, env, timeout=120)
    try:
        assert peer.ready["vllm"] == "0.0-stand-in"
        assert stopped(peer.proc.pid)
        reply = peer.run([[5, 6], [7]], [3, 2], 0.0)
        assert reply["token_ids"] == [[5, 5, 5], [7, 7]]
        assert stopped(peer.proc.pid)
    finally:
        peer.close()
    assert peer.proc.poll() is not None and not alive(peer.proc.pid)


def test_speculation_fields_cross_checked_and_ignore_eos_defaults_on():
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    config = {**CONFIG, "speculative_config": spec, "request_times": True}
    assert bench_peer.decode_config(bench_peer.encode(config)) == config
    for bad in ({"speculative_config": "ngram"}, {"request_times": 1}):
        with pytest.raises(TypeError, match=next(iter(bad))):
            bench_peer.decode_config(bench_peer.encode({**CONFIG, **bad}))
    line = json.dumps({"op": "run", "prompts": [[1, 2]], "max_tokens": [3], "temperature": 0})
    assert bench_peer.decode_command(line)["ignore_eos"] is True          # the protocol's older form: as before
    msg = bench_peer.decode_command(bench_peer.encode(bench_peer.run_message([[1, 2]], [3], 0, ignore_eos=False)))
    assert msg["ignore_eos"] is False


def test_bench_spec_compare_vllm_needs_a_peer_python_and_a_directory(tmp_path):
    from nanovllm_tp.bench import spec as bench_spec
    with pytest.raises(SystemExit, match="bench_spec: --compare vllm needs --peer-python"):
        bench_spec.main(["--compare", "vllm"])
    with pytest.raises(SystemExit, match="bench_spec: --peer-python .*no such executable"):
        bench_spec.main(["--compare", "vllm", "--peer-python", str(tmp_path / "none")])
