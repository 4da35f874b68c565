"""Prometheus exposition (``/metrics``) with vLLM's metric semantics under ``pagedchat:`` names, and ``/health``.

Engine-wide numbers (running/waiting, KV usage, prefix-cache queries and hits, token counts, finished
requests, preemptions) are read from the engine's stats snapshot at scrape time, so they can never drift
from the engine; per-request latencies are histograms the serving path observes. With several front processes
(``--api-server-count``), each front's histograms live in prometheus_client's multiprocess files and a scrape of
any front sums them all.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from engine.core.metrics import EngineStats

# set (by the process runner) when several fronts serve
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

_TTFT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_ITL_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
)
_E2E_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0)


class ServerMetrics:
    def __init__(
        self, model_name: str, stats: Callable[[], EngineStats], multiprocess: bool = False
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)  # what a scrape reports
        self.model_name = model_name
        labels = ["model_name"]
        # several fronts: this front's histograms write to the shared files, which a collector sums at scrape time
        own = CollectorRegistry() if multiprocess else self.registry
        if multiprocess:
            from prometheus_client import multiprocess as prometheus_multiprocess

            if not os.environ.get(MULTIPROC_DIR_ENV):
                raise RuntimeError(
                    f"{MULTIPROC_DIR_ENV} must be set before prometheus_client is imported"
                )
            prometheus_multiprocess.MultiProcessCollector(self.registry)
        self.ttft = Histogram(
            "pagedchat:time_to_first_token_seconds",
            "Time to first token (server arrival to first token sent).",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=own,
        )
        self.itl = Histogram(
            "pagedchat:inter_token_latency_seconds",
            "Time between consecutive output tokens.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=own,
        )
        self.e2e = Histogram(
            "pagedchat:e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=own,
        )
        self.queue_time = Histogram(
            "pagedchat:request_queue_time_seconds",
            "Time a request waited before it was first scheduled.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=own,
        )
        self.quota_refusals = Counter(
            "pagedchat:key_quota_refusals",
            "Requests refused by a per-key quota, by reason: tokens (--max-tokens-per-minute-per-key), "
            "too_large (more than that whole quota), concurrency (--max-concurrent-requests-per-key).",
            ["model_name", "reason"],
            registry=own,
        )
        self.registry.register(_EngineCollector(model_name, stats))
        # the labelled children, looked up once (a labels() call per token was a tenth of the front's time)
        self._ttft, self._itl = self.ttft.labels(model_name), self.itl.labels(model_name)
        self._e2e, self._queue_time = (
            self.e2e.labels(model_name),
            self.queue_time.labels(model_name),
        )

    def observe_first_token(self, seconds: float, queue_time: float | None) -> None:
        self._ttft.observe(seconds)
        if queue_time is not None:
            self._queue_time.observe(queue_time)

    def observe_tokens(self, seconds: float, num_tokens: int) -> None:
        """``num_tokens`` arrived ``seconds`` after the previous ones: one interval per token."""
        for _ in range(num_tokens):
            self._itl.observe(seconds / num_tokens)

    def observe_finished(self, seconds: float) -> None:
        self._e2e.observe(seconds)

    def observe_quota_refusal(self, reason: str) -> None:
        self.quota_refusals.labels(self.model_name, reason).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self._model_name = model_name
        self._stats = stats

    def describe(self) -> list[Metric]:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        label = [self._model_name]
        yield _gauge(
            "num_requests_running", "Requests in the running batch.", stats.num_running, label
        )
        yield _gauge(
            "num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting, label
        )
        yield _gauge(
            "kv_cache_usage_perc",
            "Share of KV blocks referenced by a request (1 = full).",
            stats.kv_usage,
            label,
        )
        yield _gauge("kv_cache_blocks", "KV blocks in the pool.", stats.num_blocks, label)
        yield _gauge(
            "kv_cache_pinned_blocks",
            "KV blocks pinned for preset prompts.",
            stats.num_pinned_blocks,
            label,
        )
        yield _counter(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            stats.prefix_queries,
            label,
        )
        yield _counter(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            stats.prefix_hits,
            label,
        )
        yield _counter(
            "prefix_cache_device_hits",
            "Prompt tokens found in the prefix cache on the device.",
            stats.prefix_device_hits,
            label,
        )
        yield _counter(
            "prefix_cache_host_hits",
            "Prompt tokens copied back from the host tier of the prefix cache.",
            stats.prefix_host_hits,
            label,
        )
        yield _gauge(
            "host_cache_blocks",
            "KV blocks held by the host tier of the prefix cache.",
            stats.num_host_cached_blocks,
            label,
        )
        yield from _stat_metrics(_KV_TIER_METRICS, stats, label)
        yield from _stat_metrics(_SPECULATIVE_METRICS, stats, label)
        yield _counter(
            "prompt_tokens", "Prompt tokens of admitted requests.", stats.prompt_tokens, label
        )
        yield _counter("generation_tokens", "Generated tokens.", stats.generation_tokens, label)
        yield _counter(
            "num_preemptions", "Requests preempted (recomputed later).", stats.preemptions, label
        )
        success = CounterMetricFamily(
            "pagedchat:request_success",
            "Finished requests by finish reason.",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(stats.finished.items()):
            success.add_metric([self._model_name, reason], count)
        yield success


# the prefix cache's tiers below host memory, the disk (--kv-disk-path) and Redis (--kv-redis-url):
# (name, help, the EngineStats field, a counter or a gauge)
_KV_TIER_METRICS = (
    (
        "prefix_cache_disk_hits",
        "Prompt tokens read back from the disk tier of the prefix cache.",
        "prefix_disk_hits",
        True,
    ),
    (
        "prefix_cache_redis_hits",
        "Prompt tokens read back from the Redis tier of the prefix cache.",
        "prefix_redis_hits",
        True,
    ),
    ("kv_disk_blocks", "KV blocks held by the disk tier.", "num_disk_blocks", False),
    (
        "kv_tier_read_bytes",
        "Bytes of KV blocks read from the disk and Redis tiers.",
        "kv_tier_read_bytes",
        True,
    ),
    (
        "kv_tier_written_bytes",
        "Bytes of KV blocks written to the disk and Redis tiers.",
        "kv_tier_written_bytes",
        True,
    ),
    (
        "kv_tier_restore_seconds",
        "Seconds spent reading KV blocks back from the disk and Redis tiers.",
        "kv_tier_restore_seconds",
        True,
    ),
    (
        "kv_tier_rejected_blocks",
        "KV blocks of the disk and Redis tiers found corrupt or unreadable (computed again instead).",
        "kv_tier_rejected_blocks",
        True,
    ),
)


# speculative decoding (--speculative), vLLM's names: the acceptance rate is accepted / draft tokens; a
# verification yields 1 + accepted / drafts tokens on average (its accepted drafts and the sample after them)
_SPECULATIVE_METRICS = (
    (
        "spec_decode_num_drafts",
        "Draft verifications: a sequence's draft tokens scored in one step.",
        "spec_verifications",
        True,
    ),
    (
        "spec_decode_num_draft_tokens",
        "Draft tokens verified.",
        "spec_draft_tokens",
        True,
    ),
    (
        "spec_decode_num_accepted_tokens",
        "Draft tokens accepted (equal to the token the model chose at their place).",
        "spec_accepted_tokens",
        True,
    ),
)


def _stat_metrics(
    table: tuple[tuple[str, str, str, bool], ...], stats: EngineStats, label: list[str]
) -> Iterator[Metric]:
    """One metric per row of ``table``: (name, help, the EngineStats field, a counter or a gauge)."""
    for name, doc, field, counter in table:
        yield (_counter if counter else _gauge)(name, doc, getattr(stats, field), label)


def _gauge(name: str, doc: str, value: float, label: list[str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(f"pagedchat:{name}", doc, labels=["model_name"])
    family.add_metric(label, value)
    return family


def _counter(name: str, doc: str, value: float, label: list[str]) -> CounterMetricFamily:
    family = CounterMetricFamily(f"pagedchat:{name}", doc, labels=["model_name"])
    family.add_metric(label, value)
    return family


async def metrics_endpoint(request: Request) -> Response:
    return Response(request.app.state.server.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


async def health_endpoint(request: Request) -> JSONResponse:
    """200 while the engine thread is alive; 503 once it failed or stopped (load balancers drain us). The
    session store's state is reported but does not fail the check: stateless routes still serve without it."""
    server = request.app.state.server
    healthy = server.engine.healthy
    return JSONResponse(
        {
            "status": "ok" if healthy else "unhealthy",
            "sessions": await _store_state(server.sessions.store),
        },
        status_code=200 if healthy else 503,
    )


async def _store_state(store) -> str:
    if store is None:
        return "starting"
    try:
        await asyncio.wait_for(store.ping(), timeout=1.0)
    except Exception:  # noqa: BLE001 - any failure means unavailable here
        return "unavailable"
    return store.kind
