"""Prometheus metrics of a serving engine (`GET /metrics`): vLLM's metric names, each served twice, under our
prefix (`nanovllm_tp:`, what this server always served) and under vLLM's (`vllm:`), so that vLLM's dashboards and
alerts read this server unchanged. Each metric is declared once, under our prefix; `_VllmNames` serves the copy.
The router's figures (data parallelism) have no vLLM counterpart and keep our prefix only.

Queue sizes, KV-cache usage and preemptions are the scheduler's figures as of the engine's last message (it sends
them with every step's outputs, and when idle after adds and aborts); token counters and latency histograms are
fed by every finished request.
"""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "nanovllm_tp:"
VLLM_PREFIX = "vllm:"
# vLLM's other names for one of ours, served under its prefix too. Our TPOT is each request's mean time per output
# token after the first (vLLM's request_time_per_output_token_seconds); vLLM's inter_token_latency_seconds and its
# older time_per_output_token_seconds observe every gap between two tokens instead: the same unit and, on a
# dashboard, the same meaning, with long requests weighing more.
VLLM_ALSO = {"time_per_output_token_seconds": ("inter_token_latency_seconds",
                                               "request_time_per_output_token_seconds")}
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0)


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's buckets of a per-request token count: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


def _renamed(family: Metric, name: str) -> Metric:
    """A copy of a collected metric family under another name (its samples' suffixes kept: _total, _bucket)."""
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [s._replace(name=name + s.name[len(family.name):]) for s in family.samples]
    return copy


class _VllmNames:
    """Every metric of `declared` (a registry of metrics named under PREFIX), served under PREFIX and again under
    VLLM_PREFIX (with VLLM_ALSO's other names): one declaration, one value, two names."""
    def __init__(self, declared: CollectorRegistry):
        self.declared = declared

    def collect(self):
        families = list(self.declared.collect())
        yield from families
        for family in families:
            base = family.name.removeprefix(PREFIX)
            for name in (base, *VLLM_ALSO.get(base, ())):
                yield _renamed(family, VLLM_PREFIX + name)


class _SchedulerCollector:
    def __init__(self, stats, model_name: str):
        """`stats()`: the engines' latest figures, as [(extra labels, figures)]: one engine's with no extra label,
        or a data-parallel server's replicas', each labelled dp_rank="i"."""
        self.stats, self.model_name = stats, model_name

    def collect(self):
        engines = self.stats()
        names = ["model_name", *engines[0][0]]

        def family(kind, name: str, doc: str, key: str):
            f = kind(PREFIX + name, doc, labels=names)
            for extra, s in engines:
                f.add_metric([self.model_name, *extra.values()], s[key])
            return f
        yield family(GaugeMetricFamily, "num_requests_running", "Sequences in the running queue.", "running")
        yield family(GaugeMetricFamily, "num_requests_waiting", "Sequences waiting (new or preempted).", "waiting")
        yield family(GaugeMetricFamily, "kv_cache_usage_perc", "Share of KV blocks held by live sequences (1 = full).",
                     "kv_usage")
        for name, doc, key in (("num_preemptions", "Preemptions by recompute.", "preemptions"),
                               ("spec_decode_num_draft_tokens", "Tokens proposed (speculative decoding).",
                                "draft_tokens"),
                               ("spec_decode_num_accepted_tokens", "Proposed tokens accepted (speculative decoding).",
                                "accepted_tokens"),
                               ("prefix_cache_queries", "Tokens looked up in the prefix cache.", "prefix_queries"),
                               ("prefix_cache_hits", "Tokens found in the prefix cache (their prefill skipped).",
                                "prefix_hits"),
                               ("kv_transfer_blocks_in", "KV blocks written from other engines (moved requests).",
                                "kv_blocks_in"),
                               ("kv_transfer_blocks_out", "KV blocks sent to other engines.", "kv_blocks_out"),
                               ("kv_transfer_bytes_in", "Bytes of the KV payloads imported.", "kv_bytes_in"),
                               ("kv_transfer_bytes_out", "Bytes of the KV payloads exported.", "kv_bytes_out")):
            yield family(CounterMetricFamily, name, doc, key)
        c = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Proposed tokens accepted, by "
                                "their place in the draft (speculative decoding).", labels=[*names, "position"])
        for extra, s in engines:
            for position, count in enumerate(s["accepted_per_pos"]):
                c.add_metric([self.model_name, *extra.values(), str(position)], count)
        yield c


class _RouterCollector:
    """Data-parallel serving: what the router did and each replica's state."""
    def __init__(self, replicas, model_name: str):
        self.replicas, self.model_name = replicas, model_name       # a ReplicaSet

    def collect(self):
        counters = self.replicas.router.counters()
        routed = CounterMetricFamily(PREFIX + "router_requests_routed", "Requests sent to each replica.",
                                     labels=["model_name", "dp_rank", "policy"])
        for rank, count in enumerate(counters["routed"]):
            routed.add_metric([self.model_name, str(rank), counters["policy"]], count)
        yield routed
        hits = CounterMetricFamily(PREFIX + "router_prefix_affinity_hits", "Requests sent to a replica because it "
                                   "likely held their prompt's first blocks.", labels=["model_name", "policy"])
        hits.add_metric([self.model_name, counters["policy"]], counters["prefix_hits"])
        yield hits
        for name, doc, value in (
                ("router_requests_resubmitted", "Requests run again on another replica because theirs stopped "
                 "before any of their output was read.", self.replicas.num_resubmitted),
                ("router_requests_resumed", "Streams resumed on another replica, where their client was, because "
                 "theirs stopped.", self.replicas.num_resumed),
                ("router_requests_migrated", "Of the resumed streams, those that moved with their KV (a rolling "
                 "restart's) and were not computed again.", self.replicas.num_migrated),
                ("router_kv_migrated_bytes", "Bytes of the KV payloads those requests moved with.",
                 self.replicas.kv_bytes_migrated),
                ("router_requests_rebalanced", "Running streams moved with their KV off a replica that queued "
                 "requests to one with room (--rebalance).", self.replicas.num_rebalanced),
                ("router_requests_handed_off", "Streams a prefill replica handed to a decode replica with their KV "
                 "after their first tokens (--replica-roles).", self.replicas.num_handed_off),
                ("router_kv_handoff_bytes", "Bytes of the payloads those streams moved with through the HTTP "
                 "process: their state, and their KV where it is not copied from pool to pool (kv_shared_pool; the "
                 "replicas count the KV bytes as kv_transfer_bytes).",
                 self.replicas.kv_bytes_handed_off)):
            family = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        up = GaugeMetricFamily(PREFIX + "replica_up", "1 while a replica serves, 0 while it is down or starting.",
                               labels=["model_name", "dp_rank"])
        for rank, state in enumerate(self.replicas.replica_states()):
            up.add_metric([self.model_name, str(rank)], 1.0 if state["alive"] else 0.0)
        yield up


class ServingMetrics:
    def __init__(self, stats, model_name: str, replicas=None, max_model_len: int = 1 << 20):
        """`stats()`: the engines' figures as EngineClient.labelled_stats gives them; `replicas`: a data-parallel
        server's ReplicaSet (the router's counters, the replicas up); `max_model_len`: the top of the token-count
        histograms' buckets."""
        declared = CollectorRegistry()          # vLLM's names under our prefix: served under both (_VllmNames)
        declared.register(_SchedulerCollector(stats, model_name))
        self.registry = CollectorRegistry()
        self.registry.register(_VllmNames(declared))
        if replicas is not None:
            self.registry.register(_RouterCollector(replicas, model_name))
        labels = ["model_name"]
        self.model_name = model_name
        self.num_prompt_tokens = self.num_generation_tokens = 0     # the counters' totals, for the stats line
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=declared)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=declared)
        self.requests = Counter(PREFIX + "request_success", "Finished requests by finish reason.",
                                labels + ["finished_reason"], registry=declared)
        self.prompt_lengths = Histogram(PREFIX + "request_prompt_tokens", "Prompt tokens per finished request.",
                                        labels, buckets=token_buckets(max_model_len), registry=declared)
        self.generation_lengths = Histogram(PREFIX + "request_generation_tokens", "Generated tokens per finished "
                                            "request (all its completions).", labels,
                                            buckets=token_buckets(max_model_len), registry=declared)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=_LATENCY_BUCKETS, registry=declared)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request.", labels, buckets=_LATENCY_BUCKETS, registry=declared)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to finish.", labels,
                             buckets=_LATENCY_BUCKETS, registry=declared)

    def token_totals(self) -> tuple[int, int]:
        """(prompt tokens, generated tokens) of every request finished so far (stats_log.py's throughput)."""
        return self.num_prompt_tokens, self.num_generation_tokens

    def on_finished(self, out) -> None:
        """Count one finished request (an embedding: its prompt tokens, and "stop" unless it was aborted)."""
        m = getattr(out, "metrics", None)
        prompt = len(out.prompt_token_ids)
        self.num_prompt_tokens += prompt
        self.prompt_tokens.labels(self.model_name).inc(prompt)
        self.prompt_lengths.labels(self.model_name).observe(prompt)
        if m is None:
            self.requests.labels(self.model_name, "stop" if out.outputs.embedding else "abort").inc()
            return
        self.num_generation_tokens += m.num_generation_tokens
        self.generation_tokens.labels(self.model_name).inc(m.num_generation_tokens)
        self.generation_lengths.labels(self.model_name).observe(m.num_generation_tokens)
        reason = next((c.finish_reason for c in out.outputs if c.finish_reason), "abort")
        self.requests.labels(self.model_name, reason).inc()
        if m.ttft is not None:
            self.ttft.labels(self.model_name).observe(m.ttft)
        if m.tpot is not None:
            self.tpot.labels(self.model_name).observe(m.tpot)
        if m.finish_time is not None:
            self.e2e.labels(self.model_name).observe(m.finish_time - m.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
