"""Attention, KV-write, norm, RoPE and activation kernels over the paged layout.

Every operation is a torch operator, genq::<name> (kernels/ops.py: its schema
names what it writes in place, and a fake function gives its outputs' shape,
dtype and device, so FakeTensorMode, torch.compile and CUDA graphs see it),
and one typed function here (the reference's signature, kernels/dispatch.py's
entry_point) calls it on the Triton path: CUDA tensors (real or fake) and
GENQ_FORCE_TRITON=1. Real CPU tensors go to the torch reference
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

from kernels import ops, reference
from kernels.dispatch import FORCE_ENV, entry_point, triton_enabled, triton_module
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


# Each entry point takes its reference's signature and docstring (kernels/dispatch.py's entry_point).
# RMSNorm with a residual is its own operator (it returns the sum too).
rms_norm = entry_point(reference.rms_norm, lambda x, weight, eps, residual, unit_offset: (
    (ops.rms_norm(x, weight, eps, unit_offset), None) if residual is None
    else ops.add_rms_norm(x, residual, weight, eps, unit_offset)))
apply_rope = entry_point(reference.apply_rope, ops.apply_rope)
silu_and_mul = entry_point(reference.silu_and_mul, ops.silu_and_mul)
gelu_tanh_and_mul = entry_point(reference.gelu_tanh_and_mul, ops.gelu_tanh_and_mul)
write_kv = entry_point(reference.write_kv, ops.write_kv)
paged_attention = entry_point(reference.paged_attention, ops.paged_attention)
