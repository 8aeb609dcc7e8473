"""`nanovllm-tp bench restart` on the tiny model: a rolling restart under streams, by migration and by re-prefill
(`--no-migrate-kv-on-restart`), against the same load undisturbed; no request fails, streams move with their KV
only in the first mode (copied from the restarting replica's pool), and the table reports each."""
import json

import pytest

from nanovllm_tp.bench import restart

pytestmark = [pytest.mark.spawn, pytest.mark.slow]


def test_a_rolling_restart_by_migration_and_by_reprefill(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "restart.json"
    # long enough streams (8 x 400 tokens on one thread a replica) that replica 0 stops while they run, and long
    # enough prompts (600 tokens) that the migrated KV (about 5 MB) outlasts a socket closed at once
    result = restart.main(["--model", tiny_model_dir, "--max-model-len", "1024", "--streams", "8",
                           "--prompt-tokens", "600", "--max-tokens", "400", "--before", "10", "--out", str(out)])
    points = {p["mode"]: p for p in result["points"]}
    assert sorted(points) == ["migrate", "none", "reprefill"]
    for p in points.values():
        assert p["failed"] == [] and p["streams"] == 8 and p["span_p50_s"] > 0
    assert points["migrate"]["migrated"] >= 1 and points["migrate"]["migrated"] == points["migrate"]["resumed"]
    # the KV stayed in the restarting replica's pool until copied: a few kB of state per request crossed the HTTP
    # process, where as bytes each request's 600-token prompt alone is 1.2 MB of KV
    assert 0 < points["migrate"]["migrated_payload_bytes"] < 8192 * points["migrate"]["migrated"]
    assert points["reprefill"]["migrated"] == 0 and points["reprefill"]["resumed"] >= 1
    assert points["none"]["resumed"] == 0 and points["none"]["restart_s"] is None
    assert points["migrate"]["restart_s"] > 0 and points["reprefill"]["restart_s"] > 0
    assert json.loads(out.read_text())["points"] == result["points"]
    assert "| reprefill | 0 |" in capsys.readouterr().out
