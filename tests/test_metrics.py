"""The worker's Prometheus endpoint, scraped from a real `genq worker`, and the
gateway's, each read with prometheus_client's own text parser; the shipped
Grafana dashboard queries only metrics the worker exports."""

from __future__ import annotations

import json
import re
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from celery import Celery
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from producer.gateway import GatewaySettings, create_app
from producer.protocol import TASK_NAME
from worker.processes import ROOT, WorkerProcess, free_port

QUEUE = "genq-metrics"
DASHBOARD = ROOT / "deploy" / "grafana" / "genq-workers.json"


@pytest.fixture(scope="module")
def metrics_url(tiny_model_factory: Callable[..., Path], redis_url: str, client: Celery,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    worker = WorkerProcess(tiny_model_factory("llama", max_position_embeddings=1024), redis_url, QUEUE, "metrics",
                           tmp_path_factory.mktemp("metrics") / "worker.log",
                           {"cache_tokens": 4096, "page_size": 16, "metrics_port": port})
    worker.start().wait_ready(client)
    yield f"http://127.0.0.1:{port}/metrics"
    worker.stop()


def scrape(url: str) -> dict[str, float]:
    """Every sample as name{labels} -> value, through the reference parser."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}"] = sample.value
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    key = f"{name}{{{','.join(f'{k}={v}' for k, v in sorted(labels.items()))}}}"
    return samples[key]


def test_a_scrape_reports_the_jobs_the_worker_ran(metrics_url: str, client: Celery):
    before = scrape(metrics_url)
    handles = [client.send_task(TASK_NAME, kwargs={"prompt": f"metrics {i}", "max_new_tokens": 6,
                                                   "ignore_eos": True}, queue=QUEUE) for i in range(3)]
    results = [h.get(timeout=60) for h in handles]
    after = scrape(metrics_url)
    generated = sum(r["usage"]["completion_tokens"] for r in results)
    assert value(after, "genq_generation_tokens_total") - value(before, "genq_generation_tokens_total") == generated
    assert value(after, "genq_requests_total", outcome="completed") - value(
        before, "genq_requests_total", outcome="completed") == 3
    for histogram in ("genq_time_to_first_token_seconds", "genq_inter_token_latency_seconds",
                      "genq_queue_time_seconds", "genq_e2e_request_latency_seconds"):
        assert value(after, f"{histogram}_count") - value(before, f"{histogram}_count") == 3
    assert value(after, "genq_running_jobs") == 0 and value(after, "genq_kv_cache_usage_ratio") == 0
    assert value(after, "genq_kv_cache_pages", state="free") == 4096 // 16


def test_every_metric_the_grafana_dashboard_queries_is_exported(metrics_url: str):
    exported = {key.split("{", 1)[0] for key in scrape(metrics_url)}
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\bgenq_[a-z0-9_]+", target["expr"])}
    assert len(queried) >= 12
    assert queried <= exported, sorted(queried - exported)


def test_the_gateway_counts_requests_by_endpoint_and_status(redis_url: str):
    settings = GatewaySettings(token="metrics-token", redis_url=redis_url, queue=f"genq-gw-{uuid.uuid4().hex[:8]}")
    with TestClient(create_app(settings)) as gateway:
        assert gateway.get("/healthz").status_code == 200
        assert gateway.get("/v1/tasks/some-task").status_code == 401
        assert gateway.post("/v1/tasks", headers={"Authorization": "Bearer metrics-token"},
                            json={"prompt": "x", "max_new_tokens": 0}).status_code == 422
        scraped = gateway.get("/metrics")
    samples = {}
    for family in text_string_to_metric_families(scraped.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def count(endpoint: str, status: str, method: str = "GET") -> float:
        labels = (("endpoint", endpoint), ("method", method), ("status", status))
        return samples.get(("genq_gateway_requests_total", labels), 0.0)

    assert count("/healthz", "200") == 1
    assert count("/v1/tasks/{task_id}", "401") == 1
    assert count("/v1/tasks", "422", "POST") == 1
    assert samples[("genq_gateway_request_duration_seconds_count",
                    (("endpoint", "/healthz"), ("method", "GET")))] == 1
