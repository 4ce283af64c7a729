"""The HBM roofline of decode: a decode step is memory-bound, so its floor is the bytes it must read
over the GPU's peak memory bandwidth. Pure arithmetic from the model's config (engine/memory_plan.py's
weight and KV sizes), so the figures can be checked by hand (tests/test_gpu_acceptance.py).

Bytes one decode step of `batch` jobs reads, each job `context` tokens long:
  weights: every parameter once, except the input embedding table (a step reads only its `batch`
      rows; a tied table is read whole as the lm_head, so it counts then)
  KV cache: batch * context * (K and V bytes per token, over every layer)
Activations are left out: at batch 256 they are a few MB against tens of GB.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig
from engine.memory_plan import kv_bytes_per_token, weight_bytes

#: Peak HBM bandwidth (GB/s, 1e9 bytes) by a fragment of torch.cuda.get_device_name(), most specific
#: first; the vendors' data sheets. --peak-bandwidth overrides it (or names a card missing here).
PEAK_BANDWIDTH_GBPS: tuple[tuple[str, float], ...] = (
    ("H200", 4800.0),
    ("GH200", 4000.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5, "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # the 40 GB cards
    ("L40S", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("RTX 4090", 1008.0),
)


def peak_bandwidth_gbps(device_name: str, override: float | None = None) -> float | None:
    """The override, else the table's figure for the first fragment in the name, else None (unknown card)."""
    if override is not None:
        return override
    return next((gbps for fragment, gbps in PEAK_BANDWIDTH_GBPS if fragment in device_name), None)


@dataclass(frozen=True)
class StepBytes:
    weights: int
    kv: int

    @property
    def total(self) -> int:
        return self.weights + self.kv


def decode_step_bytes(config: ModelConfig, batch: int, context: int, dtype_bytes: int,
                      cache_dtype: str = "auto") -> StepBytes:
    """Bytes one decode step must read from HBM (see the module docstring)."""
    embedding = 0 if config.tie_word_embeddings else config.vocab_size * config.hidden_size * dtype_bytes
    per_token = kv_bytes_per_token(config, cache_dtype, dtype_bytes)
    if per_token is None:
        raise ValueError(f"cache_dtype {cache_dtype!r} does not apply to this model")
    return StepBytes(weight_bytes(config, dtype_bytes) - embedding, batch * context * per_token)


def roofline_tokens_per_s(step: StepBytes, batch: int, bandwidth_gbps: float) -> float:
    """The most decode tokens a second the bandwidth allows: batch tokens per step, each step reading step.total."""
    return batch * bandwidth_gbps * 1e9 / step.total
