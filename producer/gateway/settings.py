"""Gateway settings: GENQ_GATEWAY_* for the gateway's own knobs; the shared GENQ_* names
(ClientSettings: Redis, broker, results, queue, key prefix, visibility timeout; plus the webhook
secret, callback queue and callback address policy) for what it must agree on with the workers."""

from __future__ import annotations

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import SettingsConfigDict

from producer.callbacks import DEFAULT_CALLBACK_QUEUE
from producer.settings import ClientSettings


class GatewaySettings(ClientSettings):
    model_config = SettingsConfigDict(env_prefix="GENQ_GATEWAY_", extra="ignore", populate_by_name=True)

    host: str = Field("127.0.0.1", description="address `genq gateway` binds")
    port: int = Field(8000, ge=0, le=65535, description="port `genq gateway` binds")
    token: SecretStr | None = Field(None, description="bearer token every endpoint accepts")
    allow_anonymous: bool = Field(False, description="serve without any credentials (development only)")
    model_name: str = Field("genq", min_length=1, description="the model name the OpenAI endpoints serve")
    max_queue_depth: int | None = Field(1000, ge=0, description="429 when more tasks than this wait in the queue")
    retry_after_s: int = Field(5, ge=1, description="Retry-After of a 429")
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="413 for a larger request body")
    replay_window_s: int = Field(300, ge=1, description="signed requests are accepted this close to their timestamp")
    stream_idle_timeout_s: float = Field(600.0, gt=0, description="a stream ends after this long without an event")
    keepalive_s: float = Field(15.0, gt=0, description="SSE comment sent when a stream is idle this long")
    result_timeout_s: float = Field(3600.0, gt=0, description="longest wait for a non-streamed OpenAI answer")
    card_refresh_s: float = Field(5.0, gt=0, description="re-read the workers' model card (the limits requests "
                                                         "are checked against before queueing) at most this often")

    webhook_secret: SecretStr | None = Field(None, validation_alias="GENQ_WEBHOOK_SECRET",
                                             description="HMAC key of webhook signatures and callbacks")
    callback_queue: str = Field(DEFAULT_CALLBACK_QUEUE, validation_alias="GENQ_CALLBACK_QUEUE")
    callback_allow_private_hosts: bool = Field(
        False, validation_alias="GENQ_CALLBACK_ALLOW_PRIVATE_HOSTS",
        description="accept callback URLs on loopback, private, link-local, ... addresses (trusted deployments)")
    task_record_ttl_s: int = Field(86400, ge=1, validation_alias="GENQ_RESULT_EXPIRES_S",
                                   description="an accepted identifier stays taken (and its access token valid) "
                                               "as long as the workers keep its result")

    @model_validator(mode="after")
    def _some_authentication(self) -> GatewaySettings:
        """A gateway enqueues GPU work for whoever reaches it: refuse to start open by accident."""
        if self.token is None and self.webhook_secret is None and not self.allow_anonymous:
            raise ValueError("no credentials configured: set GENQ_GATEWAY_TOKEN and/or GENQ_WEBHOOK_SECRET "
                             "(or GENQ_GATEWAY_ALLOW_ANONYMOUS=true for local development)")
        return self
