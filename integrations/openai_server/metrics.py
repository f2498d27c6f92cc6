"""Prometheus metrics of one app, in the app's own CollectorRegistry (several apps in one process
never clash): HTTP requests by endpoint and status, per-request latency histograms (time to first
token, time per output token, end to end), token counters, and the engine's gauges read from
``engine.stats()`` at scrape time."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                 2.5)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0)


class EngineCollector:
    """The engine's own counters, read when Prometheus scrapes (never stale, nothing to update)."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def describe(self):
        return []  # names are only known from a live stats() call; nothing to pre-register

    def collect(self):
        try:
            s = self.engine.stats()
        except Exception:  # a dying engine must not break /metrics
            return
        g = GaugeMetricFamily

        def gauge(name, doc, key):
            if key in s:
                yield g(name, doc, value=float(s[key]))

        def counter(name, doc, key):
            if key in s:
                yield CounterMetricFamily(name, doc, value=float(s[key]))

        yield from gauge("asyncengine_num_requests_running", "Requests in the running batch.", "num_running")
        yield from gauge("asyncengine_num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting")
        yield from gauge("asyncengine_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0-1).",
                         "kv_usage")
        yield from gauge("asyncengine_kv_cache_blocks", "KV cache blocks in all.", "num_kv_blocks")
        yield from gauge("asyncengine_kv_cache_free_blocks", "KV cache blocks free.", "num_free_kv_blocks")
        yield from gauge("asyncengine_prefix_cache_hit_rate",
                         "Prefix cache hits / queries since start, in tokens (0-1).", "prefix_cache_hit_rate")
        yield from counter("asyncengine_prefix_cache_queries", "Prefix cache queries (tokens).",
                           "prefix_cache_queries")
        yield from counter("asyncengine_prefix_cache_hits", "Prefix cache hits (tokens).", "prefix_cache_hits")
        yield from counter("asyncengine_num_preemptions", "Requests preempted since start.", "num_preemptions")
        yield from gauge("asyncengine_tokens_per_second", "Recent generation throughput.", "tokens_per_s")
        # speculative decoding (vLLM's spec_decode metrics, in our names)
        yield from counter("asyncengine_spec_decode_num_drafts", "Verify steps that had drafts.", "spec_num_drafts")
        yield from counter("asyncengine_spec_decode_num_draft_tokens", "Draft tokens proposed.",
                           "spec_num_draft_tokens")
        yield from counter("asyncengine_spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                           "spec_num_accepted_tokens")
        yield from gauge("asyncengine_spec_decode_acceptance_rate", "Accepted / proposed draft tokens (0-1).",
                         "spec_acceptance_rate")
        yield from gauge("asyncengine_spec_decode_mean_accepted_length",
                         "Tokens per verify step of a request (1 + accepted drafts).", "spec_mean_accepted_length")
        yield g("asyncengine_engine_errored", "1 once the engine has died.", value=float(bool(s.get("errored"))))
        yield from gauge("asyncengine_engine_cores_alive", "Data-parallel engine cores alive (a dead one fails only "
                         "its requests).", "cores_alive")
        yield from _grammar_metrics(self.engine)
        yield from _moe_metrics(s)
        cores = s.get("cores")  # data parallel: the same gauges per engine core, labelled
        if cores:
            for name, doc, key in (("asyncengine_core_num_requests_running", "Running requests, per engine core.",
                                    "num_running"),
                                   ("asyncengine_core_num_requests_waiting", "Waiting requests, per engine core.",
                                    "num_waiting"),
                                   ("asyncengine_core_kv_cache_usage_ratio", "KV cache usage, per engine core.",
                                    "kv_usage")):
                fam = g(name, doc, labels=["core"])
                for i, c in enumerate(cores):
                    if key in c:
                        fam.add_metric([str(i)], float(c[key]))
                yield fam


def _moe_metrics(s: dict):
    """Mixture-of-experts load balance: tokens routed to each expert (summed over the layers)."""
    if "moe_expert_tokens" not in s:
        return
    fam = CounterMetricFamily("asyncengine_moe_expert_tokens", "Tokens routed to each expert since start, "
                              "summed over the MoE layers.", labels=["expert"])
    for i, n in enumerate(s["moe_expert_tokens"]):
        fam.add_metric([str(i)], float(n))
    yield fam
    yield GaugeMetricFamily("asyncengine_moe_expert_imbalance", "Max / mean of the tokens per expert (1 = even).",
                            value=float(s["moe_expert_imbalance"]))


def _grammar_metrics(engine):
    """The engine's grammar compile service (structured/compile_service.py), once it exists."""
    config = getattr(engine, "config", None)
    if config is None:
        return
    from asyncengine.structured.compile_service import _service_key, _services  # lazy: the grammar service's state, read only when metrics are scraped

    service = _services.get(_service_key(config))
    if service is None:
        return
    cache = service.compiler.cache.stats()
    yield GaugeMetricFamily("asyncengine_grammar_cache_bytes", "Compiled grammars held (bytes, by the cache's "
                            "own accounting; bounded by --grammar-cache-bytes).", value=float(cache["bytes"]))
    yield GaugeMetricFamily("asyncengine_grammar_cache_entries", "Compiled grammars held.", value=float(cache["entries"]))
    fam = CounterMetricFamily("asyncengine_grammar_compiles", "Grammar requests by outcome: compiled, cache hit, "
                              "refused (a limit, or remembered as failed), timeout (killed at the CPU budget), "
                              "cancelled (abandoned, killed).", labels=["outcome"])
    st = service.stats
    for label, key in (("compiled", "compiles"), ("hit", "hits"), ("refused", "refused"), ("timeout", "timeouts"),
                       ("cancelled", "cancelled")):
        fam.add_metric([label], float(st[key]))
    yield fam


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.registry = r = CollectorRegistry()
        self.http_requests = Counter("asyncengine_http_requests", "HTTP requests by endpoint and status code.",
                                     ["endpoint", "method", "status"], registry=r)
        self.ttft = Histogram("asyncengine_time_to_first_token_seconds",
                              "From arrival to the first generated token.", buckets=_TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("asyncengine_time_per_output_token_seconds",
                              "Mean time between output tokens of a request.", buckets=_TPOT_BUCKETS, registry=r)
        self.queue = Histogram("asyncengine_request_queue_time_seconds",
                               "From arrival to the first step that computes the request (waiting in the queue).",
                               buckets=_TTFT_BUCKETS, registry=r)
        self.e2e = Histogram("asyncengine_e2e_request_latency_seconds", "From arrival to the last output.",
                             buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("asyncengine_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=r)
        self.generation_tokens = Counter("asyncengine_generation_tokens",
                                         "Generated tokens of finished requests.", registry=r)
        self.finished = Counter("asyncengine_requests_finished", "Engine requests finished, by finish reason.",
                                ["finish_reason"], registry=r)
        r.register(EngineCollector(engine))

    def observe(self, out, num_generated: int) -> None:
        """A finished engine request (``out`` is its last output)."""
        self.finished.labels(out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(num_generated)
        m = out.metrics
        if m is None:
            return
        if m.first_scheduled_time is not None:
            self.queue.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self.ttft.observe(max(0.0, m.first_token_time - m.arrival_time))
            if num_generated > 1 and m.last_token_time is not None:
                self.tpot.observe(max(0.0, m.last_token_time - m.first_token_time) / (num_generated - 1))
        end = m.finished_time or m.last_token_time
        if end is not None:
            self.e2e.observe(max(0.0, end - m.arrival_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class HTTPMetricsMiddleware:
    """Counts every HTTP request by endpoint (the route, or "other" so random paths cannot blow up
    the label set), method and response status."""

    def __init__(self, app, metrics: ServerMetrics, endpoints: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(msg):
            if msg["type"] == "http.response.start":
                status[0] = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            method = scope.get("method", "")
            self.metrics.http_requests.labels(
                path if path in self.endpoints else "other",
                method if method in ("GET", "POST", "HEAD", "OPTIONS") else "other", str(status[0])).inc()
