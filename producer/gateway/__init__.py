"""The genq HTTP gateway (FastAPI): signed webhooks with completion callbacks, SSE streams with
Last-Event-ID resume, OpenAI-compatible completions, admission control. Needs the `gateway`
extra; imports no torch."""

from producer.gateway.app import create_app
from producer.gateway.settings import GatewaySettings

__all__ = ["GatewaySettings", "create_app"]
