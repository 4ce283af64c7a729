"""Service settings from GENQ_* environment variables (pydantic-settings).

One place defines every knob the worker, Flower and `genq dev` share, so the
visibility timeout, queue name and key prefix can never disagree between them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from engine.fair_share import check_weights
from producer.protocol import IDENTIFIER_PATTERN, IDENTIFIER_RE, MAX_COALESCE_MS, MAX_COALESCE_TOKENS
from producer.routing import route_queue, with_lanes
from producer.settings import ClientSettings
from producer.tenants.settle import DEFAULT_USAGE_RETENTION_S

if TYPE_CHECKING:
    from engine.engine_config import EngineConfig

ENGINE_NAMES = {"ngram_draft": "use_ngram_draft"}
"""Settings whose engine option (engine/engine_config.py) has another name; the others share theirs."""
MIN_MAX_PENDING = 1024
PENDING_PER_TASK = 4
"""The engine queues up to max(MIN_MAX_PENDING, PENDING_PER_TASK * concurrency) jobs."""


class Settings(ClientSettings):
    """The producer-side settings (Redis, queue, key prefix, visibility
    timeout) plus what only a worker needs."""

    result_expires_s: int = Field(default=86400, ge=1, description="how long results stay in the backend")
    stream_maxlen: int = Field(
        default=40000, ge=10, description="events kept per replay stream (approximate trim), and more while the "
                                          "attempt being streamed has more: that one is never cut"
    )
    stream_ttl_s: int = Field(default=3600, ge=1, description="replay streams expire this long after their last event")
    stream_coalesce_ms: int = Field(
        default=0, ge=0, le=MAX_COALESCE_MS,
        description="publish a sample's chunks merged, at most this often (ms; 0: every step), for requests that do "
                    "not set stream.coalesce_ms")
    stream_coalesce_tokens: int = Field(
        default=0, ge=0, le=MAX_COALESCE_TOKENS,
        description="also publish a sample's merged chunks once this many tokens wait (0: no token trigger), for "
                    "requests that do not set stream.coalesce_tokens")
    switch_interval_ms: float = Field(
        default=5.0, gt=0, le=100,
        description="CPython's GIL switch interval in the worker (sys.setswitchinterval; CPython's default 5): how "
                    "long one of Celery's or the publishing threads may keep the GIL while the engine loop, its "
                    "forward over, waits for it. Smaller lets the loop in sooner for more switches "
                    "(bench/celery_gil.py)")

    model: str | None = Field(default=None, description="HF model directory or .gguf file the worker serves")
    mmproj: str | None = Field(default=None, description="llama.cpp mmproj .gguf file with the vision tower and "
                                                         "projector that go with the model (LLaVA-1.5's MLP)")
    device: str = Field(default="cpu", description="cpu or cuda[:N]")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        default=None, description="the model's dtype (default: the checkpoint's)")
    cache_tokens: int | None = Field(default=None, ge=1, description="KV cache size in tokens (default: 1 GiB's worth "
                                                                      "on CPU; on CUDA what `genq plan` computes)")
    gpu_memory_utilization: float | None = Field(
        default=None, gt=0, le=1,
        description="CUDA: the share of the GPU's memory the worker plans to use (default 0.9); the KV cache gets "
                    "what the weights, everything else in use and a step's reserve leave of it (docs/operations.md)")
    cache_dtype: Literal["auto", "fp8", "q8", "q4", "k8v4"] = Field(
        default="auto",
        description="KV cache storage: auto = the model's dtype; fp8, q8, q4 and k8v4 (keys 8-bit, values "
                    "4-bit) are quantized on write: 2x to 3.5x the tokens of a 16-bit cache in the same "
                    "memory (see the README's quantization table)")
    quantize: Literal["int8", "int4"] | None = Field(
        default=None,
        description="weight-only quantization of the linear layers at load; a GGUF Q4_0/Q4_1/Q4_K/Q8_0 file "
                    "maps onto it without dequantizing first")
    cpu_int8: bool = Field(
        default=False,
        description="CPU only: run the attention and MLP projections as int8 matmuls (int8 weights per output "
                    "channel, activations quantized to int8 per token on each call), as llama.cpp's 8-bit "
                    "activations do: faster, but greedy outputs no longer match transformers' fp32 token for token")
    page_size: int | None = Field(default=None, ge=1,
                                  description="KV cache page size in tokens (default: the engine's)")
    max_batch_size: int | None = Field(default=None, ge=1, description="jobs in the generator's batch at once")
    max_chunk_size: int | None = Field(default=None, ge=1, description="tokens per forward (prefill chunking budget)")
    concurrency: int = Field(default=64, ge=1, description="tasks in flight on one worker (threads pool size)")
    prefix_caching: bool = Field(default=True, description="share KV pages between requests with a common prefix")
    ngram_draft: bool = Field(default=False,
                              description="speculative decoding with n-gram drafts from each request's own "
                                          "text; pays on repetitive output at small batches")
    draft_model: str | None = Field(default=None, description="speculative decoding with a smaller model of the same "
                                                              "tokenizer")
    num_draft_tokens: int = Field(default=4, ge=1, le=16, description="draft tokens verified per request and step")
    max_speculative_batch: int = Field(default=8, ge=0,
                                       description="speculate only while at most this many requests decode")
    compile_timeout_s: float = Field(default=10.0, gt=0, le=3600,
                                     description="a request whose output constraint (grammar) takes longer to "
                                                 "start fails alone, naming this limit")
    max_grammar_size: int = Field(default=500_000, ge=1000,
                                  description="most symbols a constraint's grammar may have (llguidance's "
                                              "max_grammar_size); a larger one fails its request alone")
    metrics_port: int | None = Field(default=None, ge=1, le=65535,
                                     description="serve Prometheus metrics at http://ADDRESS:PORT/metrics")
    metrics_tenants: int = Field(default=20, ge=0, le=1000,
                                 description="tenants with a `tenant` label of their own in the usage metrics "
                                             "(the top ones by tokens over the last day at start, then the "
                                             "first new ones); the others count under \"other\"")
    usage_retention_s: int = Field(default=DEFAULT_USAGE_RETENTION_S, ge=3600,
                                   description="hourly usage counters (per tenant and API key) expire this long "
                                               "after their last count")
    metrics_address: str = Field(default="0.0.0.0", description="address the metrics port binds")
    shutdown_grace_s: float = Field(default=30.0, ge=0,
                                    description="seconds a warm shutdown lets in-flight jobs finish "
                                                "before requeueing them")
    lora: list[str] = Field(
        default_factory=list,
        description="a LoRA adapter loaded at start, as NAME=PATH (a PEFT directory on this machine); repeat the "
                    "option for more (the variable: a JSON list); requests name it in `adapter`")
    max_loras: int = Field(default=8, ge=1, le=1024,
                           description="LoRA adapters resident on the device at once; the least recently used one "
                                       "no running request holds moves to host memory for another (vLLM's "
                                       "--max-loras)")
    tenant_weights: Annotated[dict[str, float], NoDecode] = Field(
        default_factory=dict,
        description="fair share between tenants: a named tenant's weight in the engine's admission, as "
                    "NAME=WEIGHT,... (e.g. a=2,b=1); other tenants weigh 1 (docs/engine.md, Fair share)")
    newcomer_first: bool = Field(
        default=True,
        description="fair share between tenants: a tenant with nothing running (or a more urgent priority than "
                    "every running job) gets its first prefill in an engine step of its own, ahead of the running "
                    "jobs' next token (docs/engine.md, Fair share)")
    lane_reserve: int = Field(
        default=1, ge=0,
        description="with tenant lanes on (GENQ_TENANT_LANES): task slots no single queue or lane may take, kept "
                    "for another tenant's next task (docs/protocol.md, Fair share between tenants)")
    prefix_route: str | None = Field(
        default=None, pattern=r"^[0-9]{1,4}(,[0-9]{1,4})*$",
        description="prefix routes this worker also consumes, e.g. 0 or 0,1 (producer/routing.py): requests "
                    "starting alike reach the same worker, so its prefix cache hits")
    synthetic_rate: float | None = Field(
        default=None, gt=0,
        description="BENCHMARK AND TEST TOOL, never for serving: replace the model by the synthetic engine "
                    "(engine/synthetic.py), which streams word tokens at this many tokens/s over its batch, "
                    "reading only the model directory's tokenizer and config; the model card says so")
    synthetic_step_ms: float = Field(
        default=0.0, ge=0,
        description="BENCHMARK AND TEST TOOL, with --synthetic-rate only: every synthetic step lasts this many ms "
                    "more, whatever its batch (a GPU decode step's floor: its weight reads; bench/celery_gil.py)")

    @field_validator("lora")
    @classmethod
    def _adapters_named(cls, entries: list[str]) -> list[str]:
        names = [_adapter_entry(entry)[0] for entry in entries]
        repeated = sorted({name for name in names if names.count(name) > 1})
        if repeated:
            raise ValueError(f"GENQ_LORA: adapter name(s) {', '.join(repeated)} given twice")
        return entries

    @field_validator("tenant_weights", mode="before")
    @classmethod
    def _weights(cls, value: Any) -> dict[str, float]:
        return check_weights(_weight_entries(value) if isinstance(value, str) else value, "GENQ_TENANT_WEIGHTS")

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.tenant_lanes and self.lane_reserve >= self.concurrency:
            raise ValueError(f"GENQ_LANE_RESERVE: {self.lane_reserve} reserved task slots leave none of "
                             f"GENQ_CONCURRENCY={self.concurrency} to take tasks with; keep it below")
        if self.cpu_int8 and self.device != "cpu":
            raise ValueError(f"GENQ_CPU_INT8: the int8 projections run on CPU only, not GENQ_DEVICE={self.device}")
        if self.ngram_draft and self.draft_model:
            raise ValueError("GENQ_NGRAM_DRAFT and GENQ_DRAFT_MODEL: choose one way to draft")
        if self.synthetic_rate is not None:
            engine_parts = {"GENQ_LORA": bool(self.lora), "GENQ_DRAFT_MODEL": bool(self.draft_model),
                            "GENQ_NGRAM_DRAFT": self.ngram_draft, "GENQ_MMPROJ": bool(self.mmproj)}
            given = [name for name, set_ in engine_parts.items() if set_]
            if given:
                raise ValueError(f"GENQ_SYNTHETIC_RATE: the synthetic engine has no model for {', '.join(given)}")
        elif self.synthetic_step_ms:
            raise ValueError("GENQ_SYNTHETIC_STEP_MS: only with GENQ_SYNTHETIC_RATE (the synthetic engine's step)")
        for route in self.prefix_routes_served:
            if route >= self.prefix_routes:
                raise ValueError(f"GENQ_PREFIX_ROUTE: route {route} needs GENQ_PREFIX_ROUTES above {route} "
                                 f"(it is {self.prefix_routes})")
        return self

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The adapters to load at start: name -> directory."""
        return dict(_adapter_entry(entry) for entry in self.lora)

    @property
    def prefix_routes_served(self) -> list[int]:
        return sorted({int(route) for route in self.prefix_route.split(",")}) if self.prefix_route else []

    @property
    def queues(self) -> list[str]:
        """The shared queue, then the prefix routes this worker serves; each followed by its tenant lanes."""
        served = [self.queue] + [route_queue(self.queue, route) for route in self.prefix_routes_served]
        return with_lanes(served, self.tenant_lanes)

    def engine_config(self) -> EngineConfig:
        """The engine's config from these settings: each field named like an engine option (or as
        ENGINE_NAMES maps it) sets that option; unset (None) ones keep the engine's default."""
        from engine.engine_config import EngineConfig, option_names

        engine_options = option_names()
        options: dict[str, Any] = {"max_pending": max(MIN_MAX_PENDING, PENDING_PER_TASK * self.concurrency)}
        for name in type(self).model_fields:
            option = ENGINE_NAMES.get(name, name)
            value = getattr(self, name)
            if option in engine_options and value is not None:
                options[option] = value
        return EngineConfig().with_options(**options)


def _adapter_entry(entry: str) -> tuple[str, str]:
    """NAME=PATH -> (name, path); ValueError naming the entry's problem."""
    name, equals, path = entry.partition("=")
    if not equals or not path:
        raise ValueError(f"GENQ_LORA: {entry!r} is not NAME=PATH")
    if not IDENTIFIER_RE.fullmatch(name):
        raise ValueError(f"GENQ_LORA: adapter name {name!r} must match {IDENTIFIER_PATTERN}")
    return name, path


def _weight_entries(text: str) -> dict[str, float]:
    """NAME=WEIGHT,... -> {name: weight}; ValueError naming the entry that is not one."""
    weights: dict[str, float] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, _, number = entry.partition("=")
        try:
            weights[name.strip()] = float(number)
        except ValueError:
            raise ValueError(f"GENQ_TENANT_WEIGHTS: {entry!r} is not NAME=WEIGHT") from None
    return weights
