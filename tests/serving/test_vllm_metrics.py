"""What a vLLM user reads off a running server: vLLM's metric names on /metrics (beside ours, with the same values),
the periodic stats line in the server's log (and --disable-log-stats), and the Grafana dashboard's queries, each
answered by a real server's /metrics."""
import json
import pathlib
import re
import threading
import time

import httpx
import pytest

from nanovllm_tp.serving.stats_log import INTERVAL_S, StatsLogger
from tests.serving.test_serve import start_server, wait_ready

pytestmark = pytest.mark.spawn     # a server process, or several

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "examples" / "grafana" / "nanovllm-tp.json"
STATS_LINE = re.compile(r"Avg prompt throughput: [\d.]+ tokens/s, Avg generation throughput: [\d.]+ tokens/s, "
                        r"Running: (\d+) reqs, Waiting: (\d+) reqs, KV cache usage: [\d.]+%, "
                        r"Prefix cache hit rate: [\d.]+%")
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$')
# one prompt long enough to fill several 16-token blocks: sent twice, its second run finds them in the prefix cache
LONG_PROMPT = "The quick brown fox jumps over the lazy dog while the cat sleeps on the warm mat. " * 6


def scrape(port: int) -> dict[tuple, float]:
    """Every sample of /metrics: (name, sorted label pairs) -> value."""
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = tuple(sorted(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({"model_name": "tiny", **labels}.items()))), 0.0)


def complete(port: int, prompt: str, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if stream:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json={**body, "stream": True},
                          timeout=300) as r:
            assert r.status_code == 200
            for _ in r.iter_lines():
                pass
        return {}
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def settled(port: int, timeout: float = 30.0) -> dict:
    """/metrics once the engine reports no running or waiting request (it reports every second when idle)."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(port)
        idle = value(samples, "vllm:num_requests_running") == 0 and value(samples, "vllm:num_requests_waiting") == 0
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.2)


@pytest.fixture(scope="module")
def logged_server(tiny_model_dir, tmp_path_factory):
    """(port, the path of its stderr): a server with the stats line on, as by default."""
    log = tmp_path_factory.mktemp("vllm_metrics") / "stderr"
    port, ctx = start_server(tiny_model_dir, "--http-priority", "normal", stderr=open(log, "w"))
    with ctx as proc:
        wait_ready(port, proc)
        yield port, log


def test_vllm_names_count_what_the_requests_did_and_equal_ours(logged_server):
    port, _ = logged_server
    before = settled(port)
    assert value(before, "vllm:num_requests_running") == 0
    got = [complete(port, LONG_PROMPT, 12) for _ in range(2)]
    after = settled(port)
    prompt = sum(g["usage"]["prompt_tokens"] for g in got)
    generated = sum(g["usage"]["completion_tokens"] for g in got)
    assert generated == 24

    def grew(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)
    assert grew("vllm:generation_tokens_total") == generated
    assert grew("vllm:prompt_tokens_total") == prompt
    assert grew("vllm:request_success_total", finished_reason="length") == 2
    assert grew("vllm:request_generation_tokens_sum") == generated
    assert grew("vllm:request_prompt_tokens_sum") == prompt
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds", "inter_token_latency_seconds",
                      "request_time_per_output_token_seconds", "e2e_request_latency_seconds",
                      "request_prompt_tokens", "request_generation_tokens"):
        assert grew(f"vllm:{histogram}_count") == 2, histogram
        assert value(after, f"vllm:{histogram}_bucket", le="+Inf") == value(after, f"vllm:{histogram}_count")
    assert 0 < value(after, "vllm:e2e_request_latency_seconds_sum") < 300
    # the second run of the same prompt found its first blocks in the prefix cache
    assert grew("vllm:prefix_cache_hits_total") >= 16
    assert grew("vllm:prefix_cache_queries_total") >= grew("vllm:prefix_cache_hits_total")
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    assert 0.0 <= value(after, "vllm:kv_cache_usage_perc") <= 1.0
    assert ("vllm:num_preemptions_total", (("model_name", "tiny"),)) in after
    # one declaration, two names: every vllm: sample of ours has our prefix's twin, with the same value
    ours = {(name.removeprefix("nanovllm_tp:"), labels): v for (name, labels), v in after.items()
            if name.startswith("nanovllm_tp:")}
    vllm = {(name.removeprefix("vllm:"), labels): v for (name, labels), v in after.items()
            if name.startswith("vllm:") and not re.match(r"vllm:(inter_token_latency|request_time_per_output_token)",
                                                          name)}
    assert vllm == {k: v for k, v in ours.items() if k in vllm} and set(vllm) <= set(ours)


def dashboard_metrics() -> set[str]:
    """Every metric name the dashboard's PromQL uses (panel targets and template queries): the identifiers with a
    colon, as every vllm:* name has (PromQL's functions, labels and keywords have none)."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in board["templating"]["list"] if "definition" in v]
    assert len(exprs) >= 10
    names = set()
    for expr in exprs:
        found = {n for n in re.findall(r"[a-zA-Z_][a-zA-Z0-9_]*:[a-zA-Z0-9_:]*", expr)}
        assert found, f"no metric in {expr!r}"
        names |= found
    return names


def test_every_metric_of_the_grafana_dashboard_is_served(logged_server):
    port, _ = logged_server
    complete(port, "Hello, my name is", 8)
    served = {name for name, _ in settled(port)}
    used = dashboard_metrics()
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:generation_tokens_total",
            "vllm:time_to_first_token_seconds_bucket", "vllm:prefix_cache_hits_total"} <= used
    assert all(name.startswith("vllm:") for name in used), used
    assert used <= served, sorted(used - served)
    board = json.loads(DASHBOARD.read_text())
    quantiles = [t["expr"] for p in board["panels"] for t in p["targets"] if "histogram_quantile" in t["expr"]]
    assert any("time_to_first_token" in e and "0.99" in e for e in quantiles)
    assert any("inter_token_latency" in e and "0.5" in e for e in quantiles)


def keep_busy(port: int, stop: threading.Event) -> threading.Thread:
    """Long requests back to back until `stop`."""
    def run():
        while not stop.is_set():
            complete(port, "Once upon a time there", 400, stream=True)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_the_stats_line_is_logged_while_requests_run(logged_server):
    port, log = logged_server
    stop = threading.Event()
    threads = [keep_busy(port, stop) for _ in range(2)]
    try:
        deadline = time.monotonic() + 3 * INTERVAL_S + 30
        while time.monotonic() < deadline:
            lines = [m for m in map(STATS_LINE.search, log.read_text().splitlines()) if m]
            if any(int(m.group(1)) >= 1 for m in lines):
                break
            time.sleep(0.5)
        else:
            pytest.fail("no stats line with a running request: " + log.read_text()[-3000:])
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)
    line = next(line for line in log.read_text().splitlines() if STATS_LINE.search(line))
    assert line.startswith("INFO "), line


def test_disable_log_stats_silences_the_line(tiny_model_dir, tmp_path):
    log = tmp_path / "stderr"
    port, ctx = start_server(tiny_model_dir, "--http-priority", "normal", "--disable-log-stats",
                             stderr=open(log, "w"))
    with ctx as proc:
        wait_ready(port, proc)
        stop = threading.Event()
        threads = [keep_busy(port, stop)]
        time.sleep(INTERVAL_S + 3)
        stop.set()
        threads[0].join(timeout=300)
        time.sleep(2)
        assert value(scrape(port), "vllm:generation_tokens_total") > 0       # it served meanwhile
        text = log.read_text()
    assert not STATS_LINE.search(text), text[-3000:]


def test_the_stats_line_sums_an_interval_and_stops_once_idle():
    """The line's arithmetic on given figures: throughput over the interval, the prefix cache's hit rate from the
    counters' growth (a restarted replica's from zero), replicas summed; one line after the work stops, then none."""
    def engine(running=0, waiting=0, kv=0.0, queries=0, hits=0):
        return {"running": running, "waiting": waiting, "kv_usage": kv, "prefix_queries": queries,
                "prefix_hits": hits}
    now = {"engines": [engine()], "tokens": (0, 0)}
    logger = StatsLogger(lambda: [({}, e) for e in now["engines"]], lambda: now["tokens"])
    start = logger._last_time
    assert logger.line(start + 10) is None                        # idle: nothing to say
    now.update(engines=[engine(running=2, waiting=1, kv=0.25, queries=100, hits=40)], tokens=(300, 500))
    assert logger.line(start + 20) == ("Avg prompt throughput: 30.0 tokens/s, Avg generation throughput: 50.0 "
                                       "tokens/s, Running: 2 reqs, Waiting: 1 reqs, KV cache usage: 25.0%, Prefix "
                                       "cache hit rate: 40.0%")
    now.update(engines=[engine(queries=100, hits=40)])
    assert "Running: 0 reqs, Waiting: 0 reqs" in logger.line(start + 30)      # once after the work stopped
    assert logger.line(start + 40) is None
    # two replicas: summed, KV usage averaged; replica 1 restarted (its counters from zero again)
    now["engines"] = [engine(queries=100, hits=40), engine(queries=500, hits=0)]
    logger = StatsLogger(lambda: [({"dp_rank": str(i)}, e) for i, e in enumerate(now["engines"])],
                         lambda: now["tokens"])
    now["engines"] = [engine(running=1, kv=0.5, queries=150, hits=80), engine(running=3, kv=0.1, queries=60,
                                                                             hits=20)]
    line = logger.line(logger._last_time + 10)
    assert line.startswith("2 replicas: ") and "Running: 4 reqs" in line and "KV cache usage: 30.0%" in line
    assert "Prefix cache hit rate: 54.5%" in line                 # (40 + 20) / (50 + 60)
