"""Attention, KV-write, norm, RoPE and activation kernels over the paged layout.

Every operation is one function here. Today each resolves to its torch
reference (kernels/reference.py), the CPU path; the Triton implementations
for CUDA plug in behind these same names.
"""

from kernels.reference import apply_rope, paged_attention, rms_norm, silu_and_mul, write_kv

__all__ = ["apply_rope", "paged_attention", "rms_norm", "silu_and_mul", "write_kv"]
