"""bench/stage_overlap.py on a trace made by hand: the steady-decode window is rank 0's decode steps, a stage is busy
in its forward spans only, and the share of every stage at once is the intersection of their busy time."""
import json

import pytest

from nanovllm_tp.bench.stage_overlap import main, stage_overlap


def span(rank, name, start, end, kind=None):
    event = {"ph": "X", "name": name, "pid": rank + 1, "tid": rank + 1, "ts": start, "dur": end - start}
    if kind:
        event["args"] = {"step": 1, "kind": kind, "tokens": 2, "rows": 2}
    return event


EVENTS = [
    {"ph": "M", "name": "process_name", "pid": 1, "tid": 1, "args": {"name": "rank 0"}},
    span(0, "execute", -50, -20, "prefill"), span(0, "forward", -50, -20), span(1, "forward", -20, 0),
    span(0, "execute", 0, 10, "decode"), span(0, "forward", 0, 10),
    span(0, "execute", 20, 30, "decode"), span(0, "forward", 20, 30),
    span(1, "forward", 5, 15), span(1, "pp_recv", 15, 25), span(1, "forward", 25, 35),
]


def test_busy_shares_and_every_stage_at_once():
    result = stage_overlap(EVENTS)
    assert result["window_ms"] == pytest.approx(0.030) and result["decode_steps"] == 2
    assert result["busy"] == {"0": pytest.approx(20 / 30), "1": pytest.approx(15 / 30)}
    assert result["all_busy"] == pytest.approx(10 / 30)


def test_tp_ranks_of_a_stage_are_skipped_and_the_command_prints(tmp_path, capsys):
    # TP 2 x PP 2: ranks 0 and 2 lead the stages; rank 1 (stage 0's second TP rank) does not count
    events = [span(0, "execute", 0, 30, "decode"), span(0, "forward", 0, 30), span(2, "forward", 5, 20),
              span(1, "forward", 0, 30), span(2, "forward", 40, 50)]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    result = main([str(path), "--tp", "2"])
    assert result["busy"] == {"0": pytest.approx(1.0), "1": pytest.approx(0.5)}
    assert "every stage at once 50%" in capsys.readouterr().out


def test_a_trace_without_stages_or_decode_is_refused():
    with pytest.raises(ValueError, match="at least two pipeline stages"):
        stage_overlap([span(0, "execute", 0, 10, "decode"), span(0, "forward", 0, 10)])
    with pytest.raises(ValueError, match="0 decode steps"):
        stage_overlap([span(0, "execute", 0, 10, "prefill"), span(1, "forward", 0, 10)])
