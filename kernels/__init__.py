"""Attention, KV-write, norm, RoPE and activation kernels over the paged layout.

Every operation is one function here, dispatched per call:

- the Triton kernels (kernels/triton_kernels.py) when the tensors are on CUDA,
  or when the environment variable GENQ_FORCE_TRITON=1 (on CPU tensors that
  means Triton's interpreter: TRITON_INTERPRET=1 is set for you if triton has
  not been imported yet, and it is an error if it was imported without it);
- otherwise the torch reference (kernels/reference.py), the CPU path.

triton is imported only when the Triton path is first taken, so this package
imports (and the CPU path works) without triton installed; taking the Triton
path without it fails loudly. This package imports nothing else of ours.

The KV cache may be stored quantized (fp8, q8, q4, or k8v4: q8 keys and q4
values; kernels/kv_quant.py): kv_cache_format says what a cache dtype stores
for K and for V, each cache tensor's dtype selects its own format, and
write_kv / paged_attention then take the caches' scales too.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import torch

from kernels import reference
from kernels.kv_quant import KV_CACHE_DTYPES, KVCacheFormat, KVFormat, kv_cache_format

__all__ = [
    "KV_CACHE_DTYPES",
    "KVCacheFormat",
    "KVFormat",
    "apply_rope",
    "gelu_tanh_and_mul",
    "kv_cache_format",
    "paged_attention",
    "rms_norm",
    "silu_and_mul",
    "triton_enabled",
    "write_kv",
]

FORCE_ENV = "GENQ_FORCE_TRITON"


def _forced() -> bool:
    return os.environ.get(FORCE_ENV, "") not in ("", "0")


def triton_enabled(x: torch.Tensor) -> bool:
    """Whether an operation on `x` takes the Triton path."""
    return x.is_cuda or _forced()


def triton_module(x: torch.Tensor, name: str) -> ModuleType:
    """kernels.<name>, a module of Triton kernels, imported on first use: for CPU tensors in
    Triton's interpreter (TRITON_INTERPRET=1 is set if triton is not imported yet; imported
    without it is an error), so triton is never imported unless its path is taken."""
    module = sys.modules.get(f"kernels.{name}")
    if module is not None:
        return module
    if not x.is_cuda:
        if sys.modules.get("triton") is None:  # not imported yet
            os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ.get("TRITON_INTERPRET", "") in ("", "0"):
            raise RuntimeError(
                f"{FORCE_ENV}=1 on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                "before anything imports triton"
            )
    try:
        return importlib.import_module(f"kernels.{name}")
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            f"the Triton path was requested (CUDA tensors or {FORCE_ENV}=1) but kernels.{name} "
            f"cannot be imported: {exc}"
        ) from exc


def _impl(x: torch.Tensor) -> ModuleType:
    return triton_module(x, "triton_kernels") if triton_enabled(x) else reference


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    return _impl(x).rms_norm(x, weight, eps, residual, unit_offset)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    return _impl(q).apply_rope(q, k, cos, sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _impl(gate_up).silu_and_mul(gate_up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _impl(gate_up).gelu_tanh_and_mul(gate_up)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    return _impl(k).write_kv(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)


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
) -> torch.Tensor:
    return _impl(q).paged_attention(
        q, k_cache, v_cache, page_table, cu_seqlens_q, context_lens, scale, sliding_window, softcap, k_scales,
        v_scales,
    )


for _name in ("rms_norm", "apply_rope", "silu_and_mul", "gelu_tanh_and_mul", "write_kv", "paged_attention"):
    globals()[_name].__doc__ = getattr(reference, _name).__doc__
del _name
