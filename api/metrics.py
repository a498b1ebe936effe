"""Prometheus metrics: HTTP requests and latencies per route and status, TTFT per link algorithm, token counters,
queue depth, and the store's hits / misses / bytes per tier (read from store.stats() at scrape time).

Under `serve --workers N` a scrape reaches one worker, so each worker writes its values into prometheus_client's
multiprocess files (a folder the supervisor makes, named in MULTIPROC_ENV and WORKERS_ENV) and a scrape adds up every
worker's: counters and histograms summed, what is read at scrape time published as gauges, one series per worker
(`Published`). One process reads its own registry, whatever PROMETHEUS_MULTIPROC_DIR says."""

from __future__ import annotations

import logging
import os
import threading
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ragcache.engine import QueryStats
from ragcache.store import Store

from .engine_queue import REFUSALS, EngineQueue, Measuring

log = logging.getLogger("ragcache.api")
CONTENT_TYPE = CONTENT_TYPE_LATEST  # the media type app.py serves /metrics as
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
KL_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1, 3)
METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"})  # any other is "other": a
# label per made-up method would grow the registry without bound
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client as it is imported
WORKERS_ENV = "RAGCACHE_WORKERS_METRICS_DIR"  # set by `serve --workers` beside it: this process is one of them
PUBLISH_S = 5.0  # how often a worker publishes what it reads at scrape time (and before it answers a scrape)
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

# store.stats() field -> (metric suffix, help, counter?)
STORE_FIELDS = {
    "hits": ("hits", "chunk entries found", True),
    "misses": ("misses", "chunk entries not found", True),
    "corrupt": ("corrupt", "entries dropped because they failed their checksum", True),
    # a memory or GPU tier's: such entries reach a link from a slower tier (pageable memory, the disk) every time
    "unkept": ("unkept", "entries a write could not keep (over the tier's budget, or no free arena span)", True),
    "evicted": ("evicted", "entries dropped to stay within the tier's budget, least recently used first", True),
    "bytes_read": ("read_bytes", "bytes read", True),
    "bytes_written": ("written_bytes", "bytes written", True),
    "bytes": ("stored_bytes", "bytes held", False),
    "entries": ("entries", "entries held", False),
    # a tiered store's, per lasting tier: entries that would end with the process if it ended now
    "entries_behind": ("entries_behind", "entries only memory holds, to be written into this lasting tier", False),
}
# QueryStats field -> help of its counter (ragcache_FIELD, by algorithm)
TOKEN_FIELDS = {
    "prompt_tokens": "prompt tokens linked",
    "cached_tokens": "prompt tokens reused from cached KV",
    "recomputed_tokens": "prompt tokens recomputed at link time",
    "completion_tokens": "tokens generated",
}


class Collector:
    """Metric families that `collect` yields at every scrape. Without a `describe`, the registry calls nothing at
    registration."""

    def __init__(self, collect):
        self.collect = collect


def store_families(store: Store):
    """store.stats() on every scrape; a tiered store reports each tier under "tiers"."""
    try:
        stats = store.stats()
    except Exception as exc:  # noqa: BLE001 - a store that cannot report must not break /metrics
        log.warning("store stats unavailable: %s", exc)
        stats = {"tier": getattr(store, "name", "store"), "error": str(exc)}
    tiers = stats.get("tiers") or [stats]
    families = {
        field: (CounterMetricFamily if counter else GaugeMetricFamily)(
            f"ragcache_store_{suffix}", f"store: {help_}, per tier", labels=["tier"]
        )
        for field, (suffix, help_, counter) in STORE_FIELDS.items()
    }
    up = GaugeMetricFamily("ragcache_store_tier_up", "store tier reachable (1) or skipped (0)", labels=["tier"])
    for tier in tiers:
        label = str(tier.get("tier", "store"))
        for field, family in families.items():
            if isinstance(tier.get(field), (int, float)):
                family.add_metric([label], float(tier[field]))
        up.add_metric([label], 0.0 if "error" in tier or tier.get("up") is False else 1.0)
    yield from families.values()
    yield up
    if "tiers" in stats:  # the tiered store's own view: a lookup is a hit when any tier had the entry
        lookups = CounterMetricFamily("ragcache_store_lookups", "tiered store lookups by result", labels=["result"])
        lookups.add_metric(["hit"], float(stats.get("hits", 0)))
        lookups.add_metric(["miss"], float(stats.get("misses", 0)))
        yield lookups


def queue_families(q: EngineQueue):
    yield GaugeMetricFamily("ragcache_queue_depth", "requests waiting for or using the engine", value=q.depth)
    yield GaugeMetricFamily("ragcache_queue_limit", "max_queue: requests admitted before 429", value=q.max_queue)
    yield GaugeMetricFamily(
        "ragcache_client_limit", "max_per_client: requests of one client admitted before 429", value=q.max_per_client
    )
    yield CounterMetricFamily("ragcache_queue_rejected", "requests refused with 429 (queue full)", value=q.rejected)
    refused = CounterMetricFamily(
        "ragcache_refused", "requests refused admission with 429, by reason", labels=["reason"]
    )
    for reason in REFUSALS:  # every reason, at 0 too: a rate over a series that appears late misses its start
        refused.add_metric([reason], float(q.refused[reason]))
    yield refused
    yield CounterMetricFamily(
        "ragcache_cancelled_generations", "generations stopped because the client went away", value=q.cancelled
    )


def measuring_families(m: Measuring):
    checks = GaugeMetricFamily(
        "ragcache_length_checks", "queries whose raw texts are measured against the context", labels=["state"]
    )
    checks.add_metric(["running"], float(m.running))
    checks.add_metric(["waiting"], float(m.in_line))
    yield checks


class Published:
    """What a worker reads at scrape time (its queue, its store's counts), written as multiprocess gauges that keep
    one series per live worker (a `pid` label, prometheus_client's "liveall"): the worker a scrape reaches cannot
    read the others' queues or stores. Counter families become gauges of the same sample names."""

    def __init__(self, sources: list):
        self.sources = sources
        self.gauges: dict[str, Gauge] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ragcache-metrics", daemon=True)

    def start(self) -> None:
        self._publish_logged()  # a worker's series exist from its start, not from its first refresh
        self._thread.start()

    def close(self) -> None:
        self._stop.set()

    def publish(self) -> None:
        with self._lock:
            for family in (family for source in self.sources for family in source()):
                for sample in family.samples:
                    gauge = self.gauges.get(sample.name)
                    if gauge is None:
                        gauge = self.gauges[sample.name] = Gauge(
                            sample.name, family.documentation, list(sample.labels), multiprocess_mode="liveall",
                            registry=None,
                        )  # fmt: skip
                    (gauge.labels(**sample.labels) if sample.labels else gauge).set(sample.value)

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_S):
            self._publish_logged()

    def _publish_logged(self) -> None:
        try:
            self.publish()
        except Exception:  # the next refresh tries again; a scrape says what fails
            log.exception("publishing this worker's metrics failed")


class Metrics:
    def __init__(self, store: Store, queue: EngineQueue, engine=None, measuring: Measuring | None = None):
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "ragcache_http_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.body_bytes = Gauge(
            "ragcache_request_body_bytes",
            "bytes of the request bodies under way, as they arrived (max_bodies_mib)",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.latency = Histogram(
            "ragcache_http_request_duration_seconds",
            "HTTP request latency (streams: until the last byte)",
            ["route", "method", "status"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "ragcache_ttft_seconds",
            "time to first token by link algorithm",
            ["algorithm"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "ragcache_queue_wait_seconds", "time a request waited for the engine", buckets=LATENCY_BUCKETS, registry=r
        )
        self.tokens = {
            field: Counter(f"ragcache_{field}", help_, ["algorithm"], registry=r)
            for field, help_ in TOKEN_FIELDS.items()
        }
        self.compiled_chunks = Counter("ragcache_compiled_chunks", "chunks compiled by document uploads", registry=r)
        self.unstored_chunks = Counter(
            "ragcache_unstored_chunks",
            "chunks a query compiled that the store refused (logged): a later request compiles them again",
            registry=r,
        )
        self.shared_chunks = Counter(
            "ragcache_shared_chunks",
            "chunks a query missed and took from another request that was compiling them (not compiled twice)",
            registry=r,
        )
        self.guard_checks = Counter(
            "ragcache_guard_checks",
            "linked answers also linked with full by the accuracy guard",
            ["model", "algorithm"],
            registry=r,
        )
        self.guard_agreement = Gauge(
            "ragcache_guard_top1_agreement",
            "fraction of the recent guard checks whose next-token argmax equals full's",
            ["model", "algorithm"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.guard_kl = Histogram(
            "ragcache_guard_kl",
            "KL(full || linked) of the next-token distributions at the answer's first position, nats",
            ["model", "algorithm"],
            buckets=KL_BUCKETS,
            registry=r,
        )
        self.guard_skipped = Counter(
            "ragcache_guard_skipped",
            "guard checks drawn but not run: the queue was full, a check was already running, no quiet step came "
            "within the check's deadline, or its full link failed",
            ["model", "algorithm"],
            registry=r,
        )
        sources = [lambda: queue_families(queue), lambda: store_families(store)]
        if measuring is not None:
            sources.append(lambda: measuring_families(measuring))
        if engine is not None:  # the engine's own metrics (vLLM's `vllm:*`, the connector's among them)
            sources.append(lambda: engine.engine_metrics())
        self.published = Published(sources) if os.environ.get(WORKERS_ENV) else None
        if self.published is not None:
            self.published.start()
        for source in sources:
            r.register(Collector(source))

    def observe_answer(self, stats: QueryStats) -> None:
        algorithm = stats.algorithm or "unknown"
        self.ttft.labels(algorithm).observe(stats.ttft_s)
        if stats.wait_s is not None:  # vLLM says only with its stats on
            self.queue_wait.observe(stats.wait_s)
        for field, counter in self.tokens.items():
            counter.labels(algorithm).inc(getattr(stats, field))
        self.unstored_chunks.inc(stats.unstored_chunks)
        self.shared_chunks.inc(stats.shared_chunks)

    def observe_guard(self, model: str, check, agreement: float) -> None:
        self.guard_checks.labels(model, check.algorithm).inc()
        self.guard_agreement.labels(model, check.algorithm).set(agreement)
        self.guard_kl.labels(model, check.algorithm).observe(check.kl)

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        labels = (route, method, str(status))
        self.requests.labels(*labels).inc()
        self.latency.labels(*labels).observe(seconds)

    def render(self) -> bytes:
        if self.published is None:
            return generate_latest(self.registry)
        self.published.publish()  # this worker's as of now; the others' as of their last refresh
        every_worker = CollectorRegistry()
        multiprocess.MultiProcessCollector(every_worker)
        return generate_latest(every_worker)

    def close(self) -> None:
        if self.published is not None:
            self.published.close()


class MetricsMiddleware:
    """Pure ASGI (it must not wrap `receive`: streaming routes watch it for client disconnects)."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), 500

        async def send_wrapper(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope["method"] if scope["method"] in METHODS else "other"
            self.metrics.observe_request(route, method, status, time.perf_counter() - started)
