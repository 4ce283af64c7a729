"""Gateway settings: GENQ_GATEWAY_* for the gateway's own knobs; the shared GENQ_* names
(ClientSettings: Redis, broker, results, queue, key prefix, visibility timeout; plus the webhook
secret, callback queue and callback address policy) for what it must agree on with the workers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from producer.callbacks import DEFAULT_CALLBACK_QUEUE
from producer.protocol import IDENTIFIER_PATTERN, IDENTIFIER_RE, MAX_COALESCE_MS, MAX_PRIORITY, MIN_PRIORITY
from producer.settings import ClientSettings


class GatewaySettings(ClientSettings):
    model_config = SettingsConfigDict(env_prefix="GENQ_GATEWAY_", extra="ignore", populate_by_name=True)

    host: str = Field(default="127.0.0.1", description="address `genq gateway` binds")
    port: int = Field(default=8000, ge=0, le=65535, description="port `genq gateway` binds")
    token: SecretStr | None = Field(default=None, description="bearer token every endpoint accepts")
    allow_anonymous: bool = Field(default=False, description="serve without any credentials (development only)")
    model_name: str = Field(default="genq", min_length=1,
                            description="a name of the first queue's base model, besides its card's `model`")
    queues: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="the queues (worker pools) this gateway fronts, comma-separated, routed "
                                          "to by `model` (docs/gateway.md, Routing); empty: GENQ_QUEUE alone")
    max_queue_depth: int | None = Field(default=1000, ge=0,
                                        description="429 when more tasks than this wait in the queue")
    retry_after_s: int = Field(default=5, ge=1, description="Retry-After of a 429")
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024, description="413 for a larger request body")
    replay_window_s: int = Field(default=300, ge=1,
                                 description="signed requests are accepted this close to their timestamp")
    stream_idle_timeout_s: float = Field(default=600.0, gt=0,
                                         description="a stream ends after this long without an event")
    keepalive_s: float = Field(default=15.0, gt=0, description="SSE comment sent when a stream is idle this long")
    result_timeout_s: float = Field(default=3600.0, gt=0, description="longest wait for a non-streamed OpenAI answer")
    ignore_unknown_params: bool = Field(
        default=False, description="ignore (and log) OpenAI request parameters nobody defines instead of "
                                   "answering 400; for clients that send other vendors' extras")
    card_refresh_s: float = Field(default=5.0, gt=0,
                                  description="re-read the workers' model card (the limits requests "
                                              "are checked against before queueing) at most this often")
    max_streams_per_task: int = Field(default=16, ge=1,
                                      description="SSE streams (native and OpenAI) of one task open at once on "
                                                  "this gateway process; 429 past it")
    max_streams_per_client: int = Field(default=64, ge=1,
                                        description="SSE streams one client (a credential from one address) holds "
                                                    "open at once on this gateway process; 429 past it")
    stream_buffer_events: int = Field(default=1024, ge=1,
                                      description="live events waiting for one SSE reader; past it the reader "
                                                  "has fallen behind and its stream ends with a `resume` event")
    stream_coalesce_ms: int = Field(default=0, ge=0, le=MAX_COALESCE_MS,
                                    description="an OpenAI stream's chunks merged and written at most this often "
                                                "per choice (ms; 0: one per event) for requests that do not set "
                                                "stream_options.coalesce_ms; the first chunk and the last go out "
                                                "at once")
    pubsub_connections: int = Field(default=4, ge=1, le=64,
                                    description="Redis pub/sub connections every SSE reader is multiplexed over")
    redis_max_connections: int = Field(default=64, ge=1,
                                       description="Redis command connections of the gateway process (pub/sub "
                                                   "apart); a command waits for a free one")
    redis_pool_timeout_s: float = Field(default=10.0, gt=0,
                                        description="longest wait for a free Redis connection before 503")
    header_timeout_s: float = Field(default=10.0, gt=0,
                                    description="a connection whose request headers take longer is closed "
                                                "(after a 408)")
    body_timeout_s: float = Field(default=60.0, gt=0,
                                  description="a connection whose request body takes longer (from the end of "
                                              "its headers) is closed")
    write_timeout_s: float = Field(default=30.0, gt=0,
                                   description="a connection whose client takes nothing of the response for this "
                                               "long (the send buffer stays full) is closed")

    image_fetch_timeout_s: float = Field(default=10.0, gt=0, le=600,
                                         description="an image_url the gateway fetches (http or https) must arrive "
                                                     "within this long, or the request is refused (400)")
    image_url_allow_private_hosts: bool = Field(
        default=False, description="fetch image URLs on loopback, private, link-local, ... addresses (trusted "
                                   "deployments; the callbacks' address rule otherwise)")

    key_slot_ttl_s: int = Field(default=3600, ge=1,
                                description="an API key's concurrency slot is freed after this long if its task's "
                                            "end is never reported (a purged queue); longer than any task runs")
    usage_max_hours: int = Field(default=744, ge=1, le=8784,
                                 description="most hours one `GET /v1/usage` answers (400 past it)")
    files_dir: Path | None = Field(default=None, description="directory the Files API keeps uploads and batch "
                                                             "outputs in (shared by every gateway replica); "
                                                             "unset, and no GENQ_GATEWAY_FILES_S3_BUCKET: "
                                                             "/v1/files and /v1/batches answer 503")
    files_s3_bucket: str | None = Field(default=None, min_length=3, max_length=63,
                                        description="an S3-compatible bucket the Files API keeps its files in "
                                                    "instead of GENQ_GATEWAY_FILES_DIR (needs boto3: genq[s3]; "
                                                    "credentials from boto3's chain: AWS_ACCESS_KEY_ID, ...)")
    files_s3_prefix: str = Field(default="", max_length=512,
                                 description="prefix of every object the gateway keeps in the bucket ('genq/' say)")
    files_s3_endpoint_url: str | None = Field(default=None, description="the S3 API's URL (MinIO, Ceph, R2, ...); "
                                                                       "unset: AWS's own for the region")
    files_s3_region: str | None = Field(default=None, description="the bucket's region; unset: boto3's "
                                                                  "(AWS_REGION, AWS_DEFAULT_REGION, its config)")
    file_retention_s: int = Field(default=30 * 86400, ge=60, description="an uploaded or output file is deleted "
                                                                       "this long after it was made (its expires_at)")
    file_max_bytes: int = Field(default=64 * 2**20, ge=1024, description="largest batch input file; 413 past it")
    batch_max_lines: int = Field(default=50_000, ge=1, description="most requests in one batch input file")
    batch_max_line_bytes: int = Field(default=2**20, ge=256, description="longest line of a batch input file")
    batch_priority: int = Field(default=MAX_PRIORITY, ge=MIN_PRIORITY, le=MAX_PRIORITY,
                                description="the protocol priority of a batch's tasks (0 most urgent): below "
                                            "interactive traffic by default")
    batch_max_in_flight: int = Field(default=64, ge=1, description="lines of one batch queued or running at once; "
                                                                   "the next are queued as these end")
    batch_poll_s: float = Field(default=1.0, gt=0, le=60, description="how often a gateway steps the batches it drives")
    batch_resend_after_s: float = Field(default=60.0, gt=0,
                                        description="a queued batch line that shows no progress this long (the "
                                                    "broker lost it) is sent again under its task id")
    batch_lease_s: float = Field(default=30.0, gt=0, description="a batch whose driving gateway stopped stepping it "
                                                                 "is taken over by another this long after")

    webhook_secret: SecretStr | None = Field(default=None, validation_alias="GENQ_WEBHOOK_SECRET",
                                             description="HMAC key of webhook signatures and callbacks")
    callback_queue: str = Field(default=DEFAULT_CALLBACK_QUEUE, validation_alias="GENQ_CALLBACK_QUEUE")
    callback_allow_private_hosts: bool = Field(
        default=False, validation_alias="GENQ_CALLBACK_ALLOW_PRIVATE_HOSTS",
        description="accept callback URLs on loopback, private, link-local, ... addresses (trusted deployments)")
    task_record_ttl_s: int = Field(default=86400, ge=1, validation_alias="GENQ_RESULT_EXPIRES_S",
                                   description="an accepted identifier stays taken (and its access token valid) "
                                               "as long as the workers keep its result")

    grammar_check_workers: int = Field(default=2, ge=1, le=64,
                                       description="processes checking output constraints (grammars) at once, "
                                                   "off the event loop")
    grammar_check_timeout_s: float = Field(default=5.0, gt=0, le=600,
                                           description="a constraint whose check takes longer is refused (400 "
                                                       "naming this limit); waiting longer for a check process "
                                                       "is a 429")
    grammar_max_size: int = Field(default=500_000, ge=1000,
                                  description="most symbols a constraint's grammar may have (llguidance's "
                                              "max_grammar_size); a larger one is refused (400 naming it)")
    grammar_cache_size: int = Field(default=1024, ge=0,
                                    description="constraint checks remembered by the grammar's SHA-256 "
                                                "(refusals too); 0 turns the cache off")

    @field_validator("queues", mode="before")
    @classmethod
    def _split_queues(cls, value: Any) -> Any:
        """GENQ_GATEWAY_QUEUES=a,b as a list; each must name Redis keys (its card's)."""
        if isinstance(value, str):
            value = [queue.strip() for queue in value.split(",") if queue.strip()]
        for queue in value if isinstance(value, list) else ():
            if not isinstance(queue, str) or not IDENTIFIER_RE.fullmatch(queue):
                raise ValueError(f"each queue must follow the identifier rule ({IDENTIFIER_PATTERN}), got {queue!r}")
        if isinstance(value, list) and len(set(value)) != len(value):
            raise ValueError("a queue is listed twice")
        return value

    @property
    def fronted_queues(self) -> list[str]:
        """The queues routed to, in the order that decides a name two serve; the first is the
        default (native requests without `model`, GENQ_GATEWAY_MODEL_NAME)."""
        return self.queues or [self.queue]

    @model_validator(mode="after")
    def _one_file_store(self) -> GatewaySettings:
        """Files live in one place; a bucket needs boto3, refused here so that the gateway does not start."""
        if self.files_s3_bucket is None:
            return self
        if self.files_dir is not None:
            raise ValueError("GENQ_GATEWAY_FILES_DIR and GENQ_GATEWAY_FILES_S3_BUCKET are both set: the Files API "
                             "keeps its files in one place; unset one")
        try:
            import boto3  # noqa: F401
        except ImportError:
            raise ValueError("GENQ_GATEWAY_FILES_S3_BUCKET is set but boto3 is not installed: install the s3 extra "
                             "(pip install 'genq[s3]') or unset GENQ_GATEWAY_FILES_S3_BUCKET") from None
        return self

    @model_validator(mode="after")
    def _some_authentication(self) -> GatewaySettings:
        """A gateway enqueues GPU work for whoever reaches it: refuse to start open by accident."""
        if self.token is None and self.webhook_secret is None and not self.allow_anonymous:
            raise ValueError("no credentials configured: set GENQ_GATEWAY_TOKEN and/or GENQ_WEBHOOK_SECRET "
                             "(or GENQ_GATEWAY_ALLOW_ANONYMOUS=true for local development)")
        return self
