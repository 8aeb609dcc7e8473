"""bench struct-validity end to end on the tiny checkpoint: it launches our server, sends a few of its checks
through the openai client, prints the table last and writes the JSON with a verdict per check (whether the
random-weight model's answers are valid is not the point); --compare puts two runs side by side."""
import json

import pytest

from nanovllm_tp.bench import struct_validity

CHECKS = ["choice", "regex: ISO date", "tool named streamed", "person (optional email)"]


def test_checks_are_named_once_and_judged_by_their_kind():
    names = [c["name"] for c in struct_validity.CHECKS]
    assert len(names) == len(set(names)) and 16 <= len(names) <= 24
    person = struct_validity.CHECKS[0]
    ok = {"text": '{"name": "Ann", "age": 30, "email": "ann@example.com"}', "tool_calls": [], "finish_reason": "stop"}
    assert struct_validity.judge(person, ok) == "valid"
    assert struct_validity.judge(person, {**ok, "text": '{"name": "Ann", "age": 300}'}).startswith("schema: age")
    assert struct_validity.judge(person, {**ok, "text": '{"name": '}).startswith("invalid JSON")
    assert struct_validity.judge(person, {**ok, "finish_reason": "length"}) == "length"
    assert struct_validity.judge(person, {"error": "HTTP 400: no"}) == "HTTP 400: no"
    tool = next(c for c in struct_validity.CHECKS if c["name"] == "tool required")
    call = {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}
    assert struct_validity.judge(tool, {"text": "", "tool_calls": [call], "finish_reason": "tool_calls"}) == "valid"
    assert struct_validity.judge(tool, {"text": "hi", "tool_calls": [], "finish_reason": "stop"}) == "no tool call"
    grammar = next(c for c in struct_validity.CHECKS if c["kind"] == "so.grammar")
    assert struct_validity.judge(grammar, {**ok, "text": "SELECT name, email FROM users;"}) == "valid"


@pytest.mark.spawn
@pytest.mark.slow
def test_bench_struct_validity_launch_and_compare(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "ours.json"
    result = struct_validity.main(["--launch", "--model", tiny_model_dir, "--kv-cache-memory", str(32 << 20),
                                   "--max-tokens", "16", "--checks", *CHECKS, "--out", str(out), "--quiet"])
    lines = capsys.readouterr().out.rstrip().splitlines()
    assert set(lines[-1]) == {"-"} and lines[0].startswith("bench_struct_validity: 4 checks")
    assert any(line.startswith("valid ") and f"/{len(CHECKS)}" in line for line in lines)
    data = json.loads(out.read_text())
    assert data["label"] == "ours" and data["total"] == len(CHECKS) and "api_key" not in data["config"]
    assert data["config"]["base_url"].startswith("http://127.0.0.1:") and result["out"] == str(out)
    assert [r["check"] for r in data["checks"]] == [c["name"] for c in struct_validity.CHECKS if c["name"] in CHECKS]
    for row in data["checks"]:
        assert row["verdict"] and row["valid"] == (row["verdict"] == "valid")
        assert not row["verdict"].startswith(("HTTP", "APIConnection")), row
    assert data["valid"] == sum(r["valid"] for r in data["checks"])
    assert set(data["failed"]) == {r["check"] for r in data["checks"] if not r["valid"]}
    both = struct_validity.main(["--compare", str(out), str(out)])
    assert both["table"].splitlines()[2].split()[-2:] == ["ours", "ours"]
