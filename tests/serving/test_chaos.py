"""The chaos run (bench/chaos.py) as a test: a data-parallel server under 16 streams, a random rank of a random
replica killed with -9 every 10-20 s for two minutes, then SIGTERM. Every request completes (no error event, no
5xx), every greedy answer equals the undisturbed engine's under --batch-invariant, each death shows in /metrics and
/health within 2 s, the server exits 0 and leaves nothing behind."""
import pytest

from nanovllm_tp.bench import chaos

pytestmark = [pytest.mark.spawn, pytest.mark.slow]


@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "dp2-tp2"])
def test_a_data_parallel_server_heals_under_kills(tiny_model_dir, tp):
    args = chaos.build_parser().parse_args([
        "--model", tiny_model_dir, "--tensor-parallel-size", str(tp), "--batch-invariant", "--block-size", "16",
        "--max-model-len", "512", "--max-tokens", "100", "--duration", "120", "--kill-every", "10", "20",
        "--kill-seed", str(tp)])
    result = chaos.run(args)
    print(chaos.report(result))
    assert result["deaths"] >= 3 and result["streams_finished"]     # a kill waits until every replica is up
    assert result["requests"] > 100 and not result["failed"], result["failed"][:5]
    assert result["compared"] == result["requests"] and result["unequal"] == 0
    assert all(s is not None and s < 2.0 for s in result["seen_s"]), result["seen_s"]
    assert all(s is not None and s < 2.0 for s in result["health_s"]), result["health_s"]
    assert result["resumed"] + result["run_again"] >= 1
    assert result["exit_code"] == 0 and result["exit_s"] < 30
    assert not result["left_behind"], result["left_behind"]
