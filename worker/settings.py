"""Service settings from GENQ_* environment variables (pydantic-settings).

One place defines every knob the worker, Flower and `genq dev` share, so the
visibility timeout, queue name and key prefix can never disagree between them.
"""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from producer.protocol import DEFAULT_KEY_PREFIX, DEFAULT_QUEUE


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="GENQ_", extra="ignore")

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="broker, result backend and streams")
    broker_url: str | None = Field(None, description="overrides redis_url for the Celery broker")
    result_backend: str | None = Field(None, description="overrides redis_url for Celery results")
    queue: str = Field(DEFAULT_QUEUE, description="Celery queue; use one per model so models can share a Redis")
    key_prefix: str = Field(DEFAULT_KEY_PREFIX, description="prefix of every stream/channel/cancel key")
    visibility_timeout_s: int = Field(3600, ge=1, description="seconds before an unacked task is redelivered")
    result_expires_s: int = Field(86400, ge=1, description="how long results stay in the backend")
    stream_maxlen: int = Field(10000, ge=10, description="events kept per replay stream (approximate trim)")
    stream_ttl_s: int = Field(3600, ge=1, description="replay streams expire this long after their last event")

    model: str | None = Field(None, description="HF model directory the worker serves")
    device: str = Field("cpu", description="cpu or cuda[:N]")
    dtype: str | None = Field(None, description="float32 | bfloat16 | float16 (default: the checkpoint's)")
    cache_tokens: int | None = Field(None, ge=1, description="KV cache size in tokens (default: memory budget)")
    page_size: int | None = Field(None, ge=1, description="KV cache page size in tokens")
    max_batch_size: int | None = Field(None, ge=1, description="jobs in the generator's batch at once")
    max_chunk_size: int | None = Field(None, ge=1, description="tokens per forward (prefill chunking budget)")
    concurrency: int = Field(64, ge=1, description="tasks in flight on one worker (threads pool size)")
    shutdown_grace_s: float = Field(30.0, ge=0, description="warm shutdown: time to finish in-flight jobs")

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url

    @property
    def backend(self) -> str:
        return self.result_backend or self.redis_url
