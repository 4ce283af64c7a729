"""Attention, KV-write, norm, RoPE and activation kernels over the paged layout.

Every operation is a torch operator, genq::<name> (kernels/ops.py: its schema
names what it writes in place, and a fake function gives its outputs' shape,
dtype and device, so FakeTensorMode, torch.compile and CUDA graphs see it),
and one typed function here calls it on the Triton path: CUDA tensors (real or
fake) and GENQ_FORCE_TRITON=1. Real CPU tensors go to the torch reference
directly: the operator dispatcher costs 10-20 us a call, which was a quarter of
a batch-1 SmolLM2 decode step on the 2-core CPU (42.5 ms against 33.2 ms). On
the operators, the implementation is picked per call (kernels/dispatch.py):

- the Triton kernels (kernels/triton_kernels.py) when the tensors are on CUDA,
  or when the environment variable GENQ_FORCE_TRITON=1 (on CPU tensors that
  means Triton's interpreter: TRITON_INTERPRET=1 is set for you if triton has
  not been imported yet, and it is an error if it was imported without it);
- otherwise the torch reference (kernels/reference.py), the CPU path.

The Triton kernel modules are imported only when the Triton path is first
taken, so this package imports (and the CPU path works) without triton
installed; taking the Triton path without it fails loudly. (torch itself
imports triton, when installed, with torch._dynamo on the first operator
call: custom_op wraps every implementation to keep dynamo out of it.) This
package imports nothing else of ours.

The KV cache may be stored quantized (fp8, q8, q4, or k8v4: q8 keys and q4
values; kernels/kv_quant.py): kv_cache_format says what a cache dtype stores
for K and for V, each cache tensor's dtype selects its own format, and
write_kv / paged_attention then take the caches' scales too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels import ops, reference
from kernels.dispatch import FORCE_ENV, triton_enabled, triton_module
from kernels.kv_quant import KV_CACHE_DTYPES, KVCacheFormat, KVFormat, kv_cache_format
from kernels.lora import lora_add

__all__ = [
    "FORCE_ENV",
    "KV_CACHE_DTYPES",
    "KVCacheFormat",
    "KVFormat",
    "apply_rope",
    "gelu_tanh_and_mul",
    "kv_cache_format",
    "lora_add",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "triton_enabled",
    "triton_module",
    "write_kv",
]


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm (reference.rms_norm): (normed, None), or with `residual` (normed x + residual,
    x + residual): genq::rms_norm or genq::add_rms_norm."""
    if not triton_enabled(x):
        return reference.rms_norm(x, weight, eps, residual, unit_offset)
    if residual is None:
        return ops.rms_norm(x, weight, eps, unit_offset), None
    out, summed = ops.add_rms_norm(x, residual, weight, eps, unit_offset)
    return out, summed


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (reference.apply_rope): genq::apply_rope."""
    if not triton_enabled(q):
        reference.apply_rope(q, k, cos, sin)
        return
    ops.apply_rope(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of a fused [T, 2 * I] gate/up projection: genq::silu_and_mul."""
    if not triton_enabled(gate_up):
        return reference.silu_and_mul(gate_up)
    out: torch.Tensor = ops.silu_and_mul(gate_up)
    return out


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh) * up of a fused [T, 2 * I] gate/up projection: genq::gelu_tanh_and_mul."""
    if not triton_enabled(gate_up):
        return reference.gelu_tanh_and_mul(gate_up)
    out: torch.Tensor = ops.gelu_tanh_and_mul(gate_up)
    return out


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Store K/V [T, Hkv, D] into their cache slots, quantizing for a quantized cache
    (reference.write_kv): genq::write_kv, which writes the caches and scales in place."""
    if not triton_enabled(k):
        reference.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
        return
    ops.write_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    bidirectional: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over each sequence's paged context -> [T, Hq, D]
    (reference.paged_attention): genq::paged_attention. A step with bidirectional spans (Gemma 3's
    images in prefill) runs the torch reference on any device: the Triton kernel is causal only."""
    if bidirectional is not None or not triton_enabled(q):
        return reference.paged_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, context_lens, scale,
                                         sliding_window, softcap, k_scales, v_scales, bidirectional)
    out: torch.Tensor = ops.paged_attention(
        q, k_cache, v_cache, page_table, cu_seqlens_q, context_lens, scale, sliding_window, softcap, k_scales,
        v_scales,
    )
    return out
