"""bench/router_sim.py: the engine's scheduler and the serving router on the shared-prefix workload in modelled
time. Under cache pressure (each replica's cache holds about half of the prefixes) prefix-aware keeps the hit
rate of one engine holding every replica's blocks, far above round-robin's; a diversion at every load swing
(miss_threshold = load_threshold) costs hits; with room for every prefix everywhere, every policy hits alike."""
import json

import pytest

from nanovllm_tp.bench import router_sim

SMALL = ["--prefix-len", "200", "--num-requests", "64", "--concurrency", "8", "--repeats", "3",
         "--max-model-len", "512", "--quiet"]


def run(tmp_path, *extra: str) -> dict:
    out = tmp_path / "sim.json"
    result = router_sim.main([*SMALL, *extra, "--out", str(out)])
    assert json.loads(out.read_text())["figures"] == json.loads(json.dumps(result["figures"]))
    return {r["layout"]: r for r in result["figures"]["runs"]}


def test_prefix_aware_keeps_one_engines_hit_rate_under_pressure(tmp_path, capsys):
    runs = run(tmp_path, "--kv-blocks", "80")
    pa, rr, one = runs["D=2, prefix-aware"], runs["D=2, round-robin"], runs["one engine, 160 blocks"]
    assert pa["hit_rate"] >= 0.95 * one["hit_rate"]
    assert pa["hit_rate"] >= 1.4 * rr["hit_rate"]
    assert pa["ttft_p50_s"] < rr["ttft_p50_s"]
    assert sum(pa["routed"]) == sum(rr["routed"]) == 3 * 64 and min(pa["routed"]) > 0
    assert len(pa["hit_rates"]) == 3 and pa["hit_rates"][0] < pa["hit_rate"]      # the first repeat starts cold
    assert "D=2, prefix-aware" in capsys.readouterr().out


def test_diverting_at_every_swing_costs_hits(tmp_path):
    """The benchmark's own workload (8 prefixes of 600 tokens, 16 streams, 202 blocks a replica): load swings of
    more than 8 requests are common; a miss at each of them loses hits the default patience keeps."""
    common = ["--prefix-len", "600", "--num-requests", "128", "--concurrency", "16", "--max-model-len", "1024",
              "--router", "prefix-aware", "--no-one-engine"]
    patient = run(tmp_path, *common)["D=2, prefix-aware"]
    eager = run(tmp_path, *common, "--miss-threshold", "8")["D=2, prefix-aware"]
    assert eager["hit_rate"] < patient["hit_rate"] - 0.03


def test_with_room_for_every_prefix_every_policy_hits_alike(tmp_path):
    runs = run(tmp_path, "--kv-blocks", "600")
    rates = [r["hit_rate"] for r in runs.values()]
    assert max(rates) - min(rates) < 0.02


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        router_sim.simulate("round-robin", 0, 80, [([1] * 20, 4)], concurrency=1)
    with pytest.raises(SystemExit):
        router_sim.main(["--repeats", "0", "--quiet"])


def test_one_shared_prefix_spreads_to_a_replica_left_idle(tmp_path):
    """Every request shares one system prompt: its holder gets all of them until the other replica has sat idle
    through idle_routes routings, then the prefix is copied there and both replicas work (a shorter makespan).
    Without that rule (idle_routes past the run's length) one replica does everything."""
    common = ["--kv-blocks", "80", "--concurrency", "16", "--num-prefixes", "1", "--router", "prefix-aware",
              "--no-one-engine"]
    spread = run(tmp_path, *common)["D=2, prefix-aware"]
    alone = run(tmp_path, *common, "--idle-routes", "100000")["D=2, prefix-aware"]
    assert alone["routed"][1] == 0 and min(spread["routed"]) >= 0.25 * sum(spread["routed"])
    assert spread["makespan_s"] < 0.9 * alone["makespan_s"]
    assert spread["hit_rate"] >= alone["hit_rate"] - 0.01
