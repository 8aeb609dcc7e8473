"""`nanovllm-tp bench disagg` on the tiny model: both layouts at one rate against real servers, and the KV transfer
offline; every figure the table names is there and every request finished."""
import json

import pytest

from nanovllm_tp.bench import disagg

pytestmark = [pytest.mark.spawn, pytest.mark.slow]


def test_both_layouts_run_the_same_workload_and_report_it(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "disagg.json"
    result = disagg.main(["--model", tiny_model_dir, "--max-model-len", "512", "--rates", "1", "--duration", "4",
                          "--streams", "2", "--stream-tokens", "24", "--long-prompt", "100", "200",
                          "--long-tokens", "4", "--out", str(out)])
    points = {p["layout"]: p for p in result["points"]}
    assert sorted(points) == ["colocated", "disaggregated"]
    for p in points.values():
        assert p["requests"] > 2 and p["failed"] == 0 and p["long_done"] >= 1
        assert p["tpot_p50_ms"] > 0 and p["ttft_p50_s"] > 0 and p["goodput_rps"]["100"] > 0
        assert len(p["records"]) == p["requests"]
    assert json.loads(out.read_text())["points"] == result["points"]
    assert "| 1 | disaggregated |" in capsys.readouterr().out


def test_the_transfer_is_measured_against_a_copy(tiny_model_dir, tmp_path):
    result = disagg.main(["--model", tiny_model_dir, "--transfer", "--transfer-tokens", "200", "--repeats", "2",
                          "--kv-dtypes", "auto", "int8", "--out", str(tmp_path / "t.json")])
    assert [(r["kv_dtype"], r["way"]) for r in result["rows"]] == [("float32", "bytes"), ("float32", "pool"),
                                                                   ("int8", "bytes"), ("int8", "pool")]
    assert all(r["bytes"] > 0 and r["transfer_gb_s"] > 0 and r["copy_gb_s"] > 0 and r["cold_copy_gb_s"] > 0
               for r in result["rows"])
    for by_bytes, by_pool in zip(result["rows"][::2], result["rows"][1::2]):
        assert by_bytes["bytes"] == by_pool["bytes"]                     # the same KV, moved two ways
        assert by_bytes["payload_bytes"] > by_bytes["bytes"] > by_pool["payload_bytes"]
