"""Service settings from GENQ_* environment variables (pydantic-settings).

One place defines every knob the worker, Flower and `genq dev` share, so the
visibility timeout, queue name and key prefix can never disagree between them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from producer.routing import route_queue
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
    cache_dtype: Literal["auto", "fp8", "q8", "q4", "k8v4"] = Field(
        "auto", description="KV cache storage: the model's dtype, or quantized (fp8, q8, q4, k8v4: keys 8-bit, "
                         "values 4-bit) to hold more tokens")
    quantize: Literal["int8", "int4"] | None = Field(
        None, description="weight-only quantization of the linear layers at load (GGUF 4/8-bit maps directly)")
    page_size: int | None = Field(None, ge=1, description="KV cache page size in tokens")
    max_batch_size: int | None = Field(None, ge=1, description="jobs in the generator's batch at once")
    max_chunk_size: int | None = Field(None, ge=1, description="tokens per forward (prefill chunking budget)")
    concurrency: int = Field(64, ge=1, description="tasks in flight on one worker (threads pool size)")
    prefix_caching: bool = Field(True, description="share the KV pages of common prompt prefixes")
    ngram_draft: bool = Field(False, description="speculative decoding with n-gram (prompt-lookup) drafts")
    draft_model: str | None = Field(None, description="a smaller model of the same tokenizer to draft with")
    num_draft_tokens: int = Field(4, ge=1, le=16, description="draft tokens verified per job and step")
    max_speculative_batch: int = Field(8, ge=0, description="speculate only while at most this many jobs decode")
    metrics_port: int | None = Field(None, ge=1, le=65535, description="serve Prometheus metrics on this port")
    metrics_address: str = Field("0.0.0.0", description="address the metrics port binds")
    shutdown_grace_s: float = Field(30.0, ge=0, description="warm shutdown: time to finish in-flight jobs")
    prefix_route: str | None = Field(
        None, pattern=r"^[0-9]{1,4}(,[0-9]{1,4})*$",
        description="prefix routes this worker also consumes, e.g. 0 or 0,1 (producer/routing.py)")

    @model_validator(mode="after")
    def _one_drafter(self) -> Settings:
        if self.ngram_draft and self.draft_model:
            raise ValueError("GENQ_NGRAM_DRAFT and GENQ_DRAFT_MODEL: choose one way to draft")
        return self

    @model_validator(mode="after")
    def _routes_exist(self) -> Settings:
        for route in self.prefix_routes_served:
            if route >= self.prefix_routes:
                raise ValueError(f"GENQ_PREFIX_ROUTE: route {route} needs GENQ_PREFIX_ROUTES above {route} "
                                 f"(it is {self.prefix_routes})")
        return self

    @property
    def prefix_routes_served(self) -> list[int]:
        return sorted({int(route) for route in self.prefix_route.split(",")}) if self.prefix_route else []

    @property
    def queues(self) -> list[str]:
        """The shared queue, then the prefix routes this worker serves."""
        return [self.queue] + [route_queue(self.queue, route) for route in self.prefix_routes_served]
