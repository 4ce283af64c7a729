"""`genq gateway`: the app under uvicorn."""

from __future__ import annotations

import uvicorn

from producer.gateway.app import create_app
from producer.gateway.settings import GatewaySettings


def serve(host: str | None = None, port: int | None = None, log_level: str = "info") -> None:
    settings = GatewaySettings()
    # Open SSE streams would hold a shutdown forever; give them a bounded grace.
    uvicorn.run(create_app(settings), host=host or settings.host, port=settings.port if port is None else port,
                log_level=log_level.lower(), timeout_graceful_shutdown=10)
