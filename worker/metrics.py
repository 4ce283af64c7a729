"""The engine's figures for operators: Prometheus metrics of one worker, served
over HTTP for alerting and autoscaling, and the readable lines Flower shows.

Gauges and counters are read from the engine loop's stats at scrape time (the
engine already counts them; nothing is counted twice), so a scrape always sees
the same figures as `celery inspect engine_stats` and Flower. Latency
histograms are observed by the engine loop as each request finishes.

Usage per tenant (issue 29) is counted when the publisher has counted a task's usage in Redis
(worker/publisher.py), under a `tenant` label of bounded cardinality: `metrics_tenants` tenants
keep their own label (the top tenants by tokens over the last day when the worker started, then
the first new ones it counts), every other one counts under "other" (a series never changes
label, so counters stay monotonic; Redis holds the exact per-tenant figures, GET /v1/usage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from producer.protocol import Timings, Usage

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
OUTCOMES = ("completed", "failed", "cancelled", "expired", "requeued")
#: What the names of the engine's lines in a worker's `celery inspect stats` (Flower's "Other" tab) begin with.
STATS_PREFIX = "genq "
OTHER_TENANTS = "other"


def readable_stats(s: Mapping[str, Any] | None, rate_window_s: float) -> dict[str, str]:
    """The engine loop's stats (None while the model loads; tokens/s measured over rate_window_s) as
    Flower's worker page shows a worker's stats: one row per name, here one line per topic with its
    units, instead of one raw dict. The numbers themselves are `celery inspect engine_stats` and
    the Prometheus metrics."""
    if s is None:
        return {f"{STATS_PREFIX}engine": "loading the model"}
    used = 100 * s["pages_used"] / s["pages_total"] if s["pages_total"] else 0.0
    outcomes = ", ".join(f"{s[outcome]:,} {outcome}" for outcome in OUTCOMES)
    lines = {
        "jobs": f"{s['active_jobs']:,} running, {s['pending_jobs']:,} waiting; peak batch {s['peak_active_jobs']:,}",
        "KV cache": f"{s['pages_used']:,} of {s['pages_total']:,} pages in use ({used:.1f} %), {s['pages_cached']:,} "
                    f"cached, {s['pages_free']:,} free; {s['page_size']:,} tokens per page",
        "throughput": f"{s['generated_tokens_per_s']:,.1f} tokens/s over the last {rate_window_s:.0f} s",
        "tokens": f"{s['generated_tokens']:,} generated; prompts {s['prompt_tokens_computed']:,} computed, "
                  f"{s['prompt_tokens_cached']:,} from the prefix cache ({100 * s['prefix_hit_rate']:.1f} % hit rate)",
        "requests": f"{s['submitted']:,} submitted: {outcomes}",
        "preemptions": f"{s['preemptions']:,}",
        "speculative decoding": f"{s['accepted_draft_tokens']:,} of {s['drafted_tokens']:,} draft tokens accepted "
                                f"({100 * s['draft_acceptance_rate']:.1f} %)",
        "engine loop": f"{s['steps']:,} steps, busy {s['busy_s']:,.1f} s",
    }
    return {f"{STATS_PREFIX}{name}": line for name, line in lines.items()}


class EngineCollector:
    """Engine and loop stats as Prometheus metrics, computed when scraped."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        yield GaugeMetricFamily("genq_running_jobs", "Jobs in the engine's batch", value=s["active_jobs"])
        yield GaugeMetricFamily("genq_waiting_jobs", "Jobs waiting for the engine", value=s["pending_jobs"])
        yield GaugeMetricFamily("genq_kv_cache_usage_ratio", "Fraction of KV cache pages in use",
                                value=s["pages_used"] / s["pages_total"] if s["pages_total"] else 0.0)
        pages = GaugeMetricFamily("genq_kv_cache_pages", "KV cache pages by state", labels=["state"])
        for state in ("used", "free", "cached"):
            pages.add_metric([state], s[f"pages_{state}"])
        yield pages
        yield GaugeMetricFamily("genq_prefix_cache_hit_ratio", "Prompt tokens served from the prefix cache",
                                value=s["prefix_hit_rate"])
        yield CounterMetricFamily("genq_preemptions", "Jobs preempted to free KV cache", value=s["preemptions"])
        prompt = CounterMetricFamily("genq_prompt_tokens", "Prompt tokens by source", labels=["source"])
        prompt.add_metric(["computed"], s["prompt_tokens_computed"])
        prompt.add_metric(["cached"], s["prompt_tokens_cached"])
        yield prompt
        yield CounterMetricFamily("genq_generation_tokens", "Generated tokens", value=s["generated_tokens"])
        yield CounterMetricFamily("genq_speculative_draft_tokens", "Draft tokens proposed",
                                  value=s["drafted_tokens"])
        yield CounterMetricFamily("genq_speculative_accepted_tokens", "Draft tokens accepted",
                                  value=s["accepted_draft_tokens"])
        requests = CounterMetricFamily("genq_requests", "Requests finished by the engine loop", labels=["outcome"])
        for outcome in OUTCOMES:
            requests.add_metric([outcome], s[outcome])
        yield requests


class TenantLabels:
    """A tenant's label: its name for `limit` tenants (those of `first`, then the first seen),
    else OTHER_TENANTS."""

    def __init__(self, limit: int, first: list[str] | None = None) -> None:
        self.limit = limit
        self._named: set[str] = set((first or [])[:limit])

    def __call__(self, tenant: str) -> str:
        if tenant in self._named:
            return tenant
        if len(self._named) < self.limit:
            self._named.add(tenant)
            return tenant
        return OTHER_TENANTS


class WorkerMetrics:
    """The worker's registry: the engine collector, latency histograms and usage per tenant."""

    def __init__(self, tenant_labels: int, top_tenants: list[str] | None = None) -> None:
        """top_tenants: who gets the tenant labels first (producer/tenants/ranking.py)."""
        self.registry = CollectorRegistry()
        self.tenant_label = TenantLabels(tenant_labels, top_tenants)
        self.tenant_tokens = Counter("genq_tenant_tokens", "Tokens of finished tasks by tenant and kind (prompt, "
                                     "completion, cached)", ["tenant", "kind"], registry=self.registry)
        self.tenant_requests = Counter("genq_tenant_requests", "Tasks finished with a result, by tenant",
                                       ["tenant"], registry=self.registry)

        def histogram(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, registry=self.registry, buckets=LATENCY_BUCKETS_S)

        self.queue = histogram("genq_queue_time_seconds", "Time from the engine taking a job to its first forward")
        self.ttft = histogram("genq_time_to_first_token_seconds", "Time from the engine taking a job to its first "
                              "generated token")
        self.itl = histogram("genq_inter_token_latency_seconds", "Mean time between a job's generated tokens")
        self.e2e = histogram("genq_e2e_request_latency_seconds", "Time from the engine taking a job to its end")

    def watch(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(EngineCollector(stats))

    def observe(self, timings: Timings, usage: Usage) -> None:
        """One finished job's latencies (the engine's own timings)."""
        self.queue.observe(timings.queued_s)
        self.ttft.observe(timings.queued_s + timings.prefill_s)
        if usage.completion_tokens > 1:
            self.itl.observe(timings.generate_s / (usage.completion_tokens - 1))
        self.e2e.observe(timings.queued_s + timings.prefill_s + timings.generate_s)

    def count_usage(self, tenant: str, usage: Usage) -> None:
        """One task's usage, counted once in Redis (the publisher's on_usage)."""
        label = self.tenant_label(tenant)
        self.tenant_tokens.labels(label, "prompt").inc(usage.prompt_tokens)
        self.tenant_tokens.labels(label, "completion").inc(usage.completion_tokens)
        self.tenant_tokens.labels(label, "cached").inc(usage.cached_tokens)
        self.tenant_requests.labels(label).inc()

    def serve(self, port: int, address: str) -> None:
        start_http_server(port, addr=address, registry=self.registry)
