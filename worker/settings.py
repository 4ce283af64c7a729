"""Service settings from GENQ_* environment variables (pydantic-settings).

One place defines every knob the worker, Flower and `genq dev` share, so the
visibility timeout, queue name and key prefix can never disagree between them.
"""

from __future__ import annotations

from pydantic import Field

from producer.settings import ClientSettings


class Settings(ClientSettings):
    """The producer-side settings (Redis, queue, key prefix, visibility
    timeout) plus what only a worker needs."""

    result_expires_s: int = Field(86400, ge=1, description="how long results stay in the backend")
    stream_maxlen: int = Field(
        40000, ge=10, description="events kept per replay stream (approximate trim; above MAX_NEW_TOKENS)"
    )
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
