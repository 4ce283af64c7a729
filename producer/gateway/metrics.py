"""Prometheus metrics of the gateway: requests and latencies by endpoint and status.

A plain ASGI middleware, so streamed responses (SSE) are timed to their last
byte and errors raised by any layer are counted. Endpoints are labelled by
their route template (`/v1/tasks/{task_id}`), never the raw path, so a
client cannot grow the label set.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("genq_gateway_requests", "HTTP requests by endpoint and status",
                                ["method", "endpoint", "status"], registry=self.registry)
        self.latency = Histogram("genq_gateway_request_duration_seconds", "HTTP request time to the last byte",
                                 ["method", "endpoint"], registry=self.registry, buckets=LATENCY_BUCKETS_S)

    async def endpoint(self, request: Request) -> Response:
        """GET /metrics."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


class MetricsMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500

        async def record_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, record_status)
        finally:
            endpoint = _route_template(scope)
            self.metrics.requests.labels(scope["method"], endpoint, str(status)).inc()
            self.metrics.latency.labels(scope["method"], endpoint).observe(time.perf_counter() - started)


def _route_template(scope: Scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "unmatched"
