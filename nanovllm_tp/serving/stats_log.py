"""The server's periodic stats line, as vLLM logs one: every INTERVAL_S while requests run, and once more after they
stop (then idle servers stay quiet), one INFO line in the HTTP process's log:

    Avg prompt throughput: 95.1 tokens/s, Avg generation throughput: 310.4 tokens/s, Running: 4 reqs,
    Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit rate: 41.0%

It reads only what the HTTP process has already: each engine's latest figures (EngineClient.labelled_stats: queues,
KV usage, the prefix cache's cumulative lookups and hits) and the token totals of finished requests that /metrics
counts (ServingMetrics.token_totals). So a request's tokens count in the interval it finishes in: a request longer
than the interval shows as running with its throughput in the line after it ends. Under data parallelism the line
sums the replicas (queues, tokens, the prefix cache's lookups) and averages their KV usage, and says how many there
are: one line a server, whatever its size. `serve --disable-log-stats` (vLLM's flag) turns it off.
"""
import asyncio
import logging
import time

log = logging.getLogger("nanovllm_tp")
INTERVAL_S = 10.0         # vLLM's default (VLLM_LOG_STATS_INTERVAL)


class StatsLogger:
    def __init__(self, stats, token_totals, interval: float = INTERVAL_S):
        """`stats()`: [(labels, an engine's figures)] (EngineClient.labelled_stats, one entry per replica);
        `token_totals()`: (prompt, generated) tokens of the requests finished so far."""
        self.stats, self.token_totals, self.interval = stats, token_totals, interval
        self._last_time = time.monotonic()
        self._last_tokens = token_totals()
        self._last_prefix = self._prefix_counts()
        self._was_busy = False

    def _prefix_counts(self) -> list[tuple[int, int]]:
        return [(s["prefix_queries"], s["prefix_hits"]) for _, s in self.stats()]

    def line(self, now: float | None = None) -> str | None:
        """The interval's line since the last call, or None when there is nothing to say (idle now and at the
        last call)."""
        now = time.monotonic() if now is None else now
        elapsed, self._last_time = max(now - self._last_time, 1e-9), now
        engines = [s for _, s in self.stats()]
        tokens = self.token_totals()
        prompt, generated = (t - t0 for t, t0 in zip(tokens, self._last_tokens))
        self._last_tokens = tokens
        prefix = self._prefix_counts()
        queries = hits = 0
        for (q, h), (q0, h0) in zip(prefix, self._last_prefix):
            fresh = q < q0                     # a replica that restarted counts from zero again
            queries += q if fresh else q - q0
            hits += h if fresh else h - h0
        self._last_prefix = prefix
        running = sum(s["running"] for s in engines)
        waiting = sum(s["waiting"] for s in engines)
        busy = bool(running or waiting or prompt or generated)
        if not (busy or self._was_busy):
            return None
        self._was_busy = busy
        kv_usage = sum(s["kv_usage"] for s in engines) / len(engines)
        text = (f"Avg prompt throughput: {prompt / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{generated / elapsed:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {100 * kv_usage:.1f}%, Prefix cache hit rate: "
                f"{100 * hits / queries if queries else 0.0:.1f}%")
        return text if len(engines) == 1 else f"{len(engines)} replicas: {text}"

    async def run(self) -> None:
        """Log the line every interval, until cancelled (on the HTTP process's event loop)."""
        while True:
            await asyncio.sleep(self.interval)
            text = self.line()
            if text is not None:
                log.info("%s", text)
