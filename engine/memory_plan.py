"""Memory planning without loading weights: how a model's weights, one step's activations and the
paged KV cache share a GPU, from the model's config alone. Pure arithmetic (no torch), so
`genq plan` answers in a second, and the CUDA worker sizes its cache by the same rule
(cuda_cache_bytes, called by engine/loading.py).

Weights: every parameter CausalLM builds (engine/model.py, layers.py, moe.py), counted from the
config's shapes. int8 / int4 (engine/quantized_linear.py) replace the attention and dense-MLP
projections; embeddings, lm_head, norms, biases, MoE routers and experts stay in the activation
dtype. int8: one byte a weight and an fp32 scale per output row (per group of 32 from a GGUF
file); int4: half a byte a weight and an fp32 scale and offset per group of 32.

KV cache: kernels/kv_quant.py's layouts, restated without torch (tests/test_memory_plan.py pins
them to kv_cache_format): per layer, KV head and token a K and a V vector of head_dim values,
"auto" in the model's dtype, fp8 / q8 one byte a value plus an fp16 scale per group of 32, q4 half
a byte plus an fp16 scale and minimum per group of 16, k8v4 q8 keys and q4 values. Every layer
holds every token: Gemma's sliding-window layers share the global layers' page tables, so they
cost as much as a global layer (engine/kv_manager.py frees out-of-window pages only when every
layer slides; a Mistral-style model then holds fewer pages per job than counted here).

Step reserve (what a step allocates beside weights and cache), with a the activation dtype's bytes:
  activations = max_chunk_size * a * (2 * hidden + max(attention width, MLP width))
      attention width = (heads + 2 * kv_heads) * head_dim + heads * head_dim   (qkv, attention out)
      MLP width = 3 * intermediate (gate_up, then its activation); MoE: top_k * (3 * expert
      intermediate + 2 * hidden) + experts (the routed rows, their outputs, the router logits)
  logits = max_batch_size * vocab * (a + 3 * 4 + 9)
      (lm_head's output, fp32 logits, the sampler's edited copy and distribution, and its per-slot
      penalty tables: a bool and two fp32 per vocabulary entry)
The GPU's memory times gpu_memory_utilization is the budget; what it leaves out covers the CUDA
context, allocator slack and CUDA graphs.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.engine_config import DEFAULT_MAX_BATCH_SIZE, DEFAULT_MAX_CHUNK_SIZE, EngineConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZE_FORMATS = ("int8", "int4")  # quantized_linear.QUANTIZE_FORMATS
KV_FORMATS = ("auto", "fp8", "q8", "q4", "k8v4")
INT4_GROUP_SIZE = 32  # quantized_linear.DEFAULT_INT4_GROUP_SIZE
GGUF_GROUP_SIZE = 32  # gguf_file.GGUF_GROUP_SIZE: int8 from a GGUF file keeps its 32-value blocks
_QUANT_PARAM_BYTES = 4  # fp32 scales and offsets of quantized weights
_KV_SCALE_BYTES = 2  # fp16 scales (and q4 minimums) of a quantized KV cache
_KV_GROUP = {"fp8": 32, "q8": 32, "q4": 16}
_SPLIT_KV = {"k8v4": ("q8", "q4")}
_FP32 = 4
_LOGIT_BYTES_PER_ENTRY = 3 * _FP32 + 1 + 2 * _FP32  # fp32 logits, edited copy, distribution; penalty tables


class PlanError(ValueError):
    """The plan is impossible: the message names the quantity and the limit."""


@dataclass(frozen=True)
class Weight:
    """`count` parameters of rows x cols each; quantizable: a projection int8 / int4 layers replace."""

    rows: int
    cols: int
    count: int = 1
    quantizable: bool = False

    @property
    def params(self) -> int:
        return self.rows * self.cols * self.count


def model_weights(config: ModelConfig) -> list[Weight]:
    """Every parameter of CausalLM(config), as shapes (vectors are 1 x n)."""
    hidden, layers, head_dim = config.hidden_size, config.num_layers, config.head_dim
    q, kv = config.num_heads * head_dim, config.num_kv_heads * head_dim
    weights = [Weight(config.vocab_size, hidden), Weight(1, hidden)]
    if not config.tie_word_embeddings:
        weights.append(Weight(config.vocab_size, hidden))
    weights += [Weight(q + 2 * kv, hidden, layers, True), Weight(hidden, q, layers, True),
                Weight(1, hidden, layers * (4 if config.sandwich_norms else 2))]
    if config.qkv_bias:
        weights.append(Weight(1, q + 2 * kv, layers))
    if config.o_bias:
        weights.append(Weight(1, hidden, layers))
    if config.qk_norm:
        weights.append(Weight(1, head_dim, 2 * layers))
    moe = sum(config.layer_is_moe(i) for i in range(layers))
    dense, inter = layers - moe, config.intermediate_size
    if dense:
        weights += [Weight(2 * inter, hidden, dense, True), Weight(hidden, inter, dense, True)]
        if config.mlp_bias:
            weights += [Weight(1, 2 * inter, dense), Weight(1, hidden, dense)]
    if moe:
        experts, expert_inter = config.num_experts, config.moe_intermediate_size
        weights += [Weight(experts, hidden, moe), Weight(2 * expert_inter, hidden, moe * experts),
                    Weight(hidden, expert_inter, moe * experts)]
    return weights


def parameter_count(config: ModelConfig) -> int:
    return sum(w.params for w in model_weights(config))


def weight_bytes(config: ModelConfig, dtype_bytes: int, quantize: str | None = None, gguf: bool = False) -> int:
    """Bytes of the model's weights in a dtype of dtype_bytes, its projections quantized to
    quantize (None: not); gguf: int8 keeps a GGUF file's groups of 32."""
    if quantize is not None and quantize not in QUANTIZE_FORMATS:
        raise PlanError(f"quantize {quantize!r} is not one of {', '.join(QUANTIZE_FORMATS)}")
    total = 0
    for w in model_weights(config):
        if quantize is not None and w.quantizable:
            total += w.count * _quantized_matrix_bytes(w.rows, w.cols, quantize, gguf)
        else:
            total += w.params * dtype_bytes
    return total


def _quantized_matrix_bytes(rows: int, cols: int, fmt: str, gguf: bool) -> int:
    if fmt == "int8":
        groups = cols // GGUF_GROUP_SIZE if gguf else 1
        return rows * cols + rows * groups * _QUANT_PARAM_BYTES
    return rows * cols // 2 + 2 * rows * (cols // INT4_GROUP_SIZE) * _QUANT_PARAM_BYTES


def kv_bytes_per_token(config: ModelConfig, cache_dtype: str, dtype_bytes: int) -> int | None:
    """Bytes one token's K and V take over all layers, scales included (None: the format cannot
    split this head_dim into its groups)."""
    if cache_dtype not in KV_FORMATS:
        raise PlanError(f"cache_dtype {cache_dtype!r} is not one of {', '.join(KV_FORMATS)}")
    k_name, v_name = _SPLIT_KV.get(cache_dtype, (cache_dtype, cache_dtype))
    k, v = (_kv_vector_bytes(name, config.head_dim, dtype_bytes) for name in (k_name, v_name))
    if k is None or v is None:
        return None
    return config.num_layers * config.num_kv_heads * (k + v)


def _kv_vector_bytes(name: str, head_dim: int, dtype_bytes: int) -> int | None:
    if name == "auto":
        return head_dim * dtype_bytes
    group = min(_KV_GROUP[name], head_dim)
    if head_dim % group or head_dim % 2:
        return None
    if name == "q4":
        return head_dim // 2 + 2 * (head_dim // group) * _KV_SCALE_BYTES
    return head_dim + head_dim // group * _KV_SCALE_BYTES


@dataclass(frozen=True)
class StepReserve:
    """Memory one step allocates beside weights and cache (the formula is the module docstring's)."""

    max_chunk_size: int
    max_batch_size: int
    activation_bytes: int
    logits_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.activation_bytes + self.logits_bytes


def step_reserve(config: ModelConfig, dtype_bytes: int, max_chunk_size: int | None = None,
                 max_batch_size: int | None = None) -> StepReserve:
    """The reserve for the scheduler's limits (None: the engine's defaults, as resolve_limits takes them)."""
    chunk = max_chunk_size or DEFAULT_MAX_CHUNK_SIZE
    batch = max_batch_size or min(DEFAULT_MAX_BATCH_SIZE, chunk)
    hidden, head_dim = config.hidden_size, config.head_dim
    attention = (2 * config.num_heads + 2 * config.num_kv_heads) * head_dim
    if config.num_experts:
        mlp = config.num_experts_per_tok * (3 * config.moe_intermediate_size + 2 * hidden) + config.num_experts
        if any(not config.layer_is_moe(i) for i in range(config.num_layers)):
            mlp = max(mlp, 3 * config.intermediate_size)
    else:
        mlp = 3 * config.intermediate_size
    activations = chunk * dtype_bytes * (2 * hidden + max(attention, mlp))
    logits = batch * config.vocab_size * (dtype_bytes + _LOGIT_BYTES_PER_ENTRY)
    return StepReserve(chunk, batch, activations, logits)


@dataclass(frozen=True)
class CachePlan:
    """How the KV cache fits a GPU: what is left of gpu_bytes * utilization after the weights and
    the step reserve, in pages of page_size tokens, and how many jobs of job_tokens fit at once."""

    gpu_bytes: int
    utilization: float
    weight_bytes: int
    reserve: StepReserve
    cache_dtype: str
    kv_bytes_per_token: int
    page_size: int
    num_pages: int
    job_tokens: int

    @property
    def page_bytes(self) -> int:
        return self.kv_bytes_per_token * self.page_size

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    @property
    def cache_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def pages_per_job(self) -> int:
        return -(-self.job_tokens // self.page_size)

    @property
    def jobs_fit(self) -> int:
        return self.num_pages // self.pages_per_job


def plan_cache(config: ModelConfig, gpu_bytes: int, weights: int, cache_dtype: str, dtype_bytes: int,
               page_size: int, job_tokens: int, utilization: float, max_chunk_size: int | None = None,
               max_batch_size: int | None = None) -> CachePlan:
    """The plan, or PlanError when not even one job of job_tokens fits (the message gives the
    smallest GPU memory that would hold it)."""
    per_token = kv_bytes_per_token(config, cache_dtype, dtype_bytes)
    if per_token is None:
        raise PlanError(f"cache_dtype {cache_dtype!r} cannot store head_dim={config.head_dim}; use 'auto'")
    reserve = step_reserve(config, dtype_bytes, max_chunk_size, max_batch_size)
    budget = int(gpu_bytes * utilization) - weights - reserve.total_bytes
    page_bytes = per_token * page_size
    plan = CachePlan(gpu_bytes, utilization, weights, reserve, cache_dtype, per_token, page_size,
                     max(0, budget // page_bytes), job_tokens)
    if plan.jobs_fit < 1:
        needed = weights + reserve.total_bytes + plan.pages_per_job * page_bytes
        raise PlanError(
            f"{gpu_bytes / 2**30:.2f} GiB at utilization {utilization:g} cannot hold one job of {job_tokens} "
            f"tokens: weights {weights / 2**30:.2f} GiB + step reserve {reserve.total_bytes / 2**30:.2f} GiB + "
            f"{plan.pages_per_job} pages {plan.pages_per_job * page_bytes / 2**30:.2f} GiB need at least "
            f"{needed / utilization / 2**30:.2f} GiB ({-(-needed / utilization // 1):.0f} bytes)")
    return plan


def cuda_cache_bytes(config: ModelConfig, dtype_bytes: int, total: int, free: int, engine: EngineConfig) -> int:
    """The CUDA worker's cache budget once the weights are loaded: total * gpu_memory_utilization,
    less what is already in use (weights, CUDA context, other processes: total - free) and the step
    reserve. PlanError naming gpu_memory_utilization when nothing is left."""
    utilization = engine.cache.gpu_memory_utilization
    reserve = step_reserve(config, dtype_bytes, engine.scheduler.max_chunk_size, engine.scheduler.max_batch_size)
    budget = int(total * utilization) - (total - free) - reserve.total_bytes
    if budget <= 0:
        raise PlanError(
            f"gpu_memory_utilization={utilization:g} of {total / 2**30:.2f} GiB leaves no KV cache: "
            f"{(total - free) / 2**30:.2f} GiB in use after loading and a {reserve.total_bytes / 2**30:.2f} GiB "
            f"step reserve; raise it, lower max_batch_size / max_chunk_size, or set cache_tokens")
    return budget
