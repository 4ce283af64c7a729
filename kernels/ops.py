"""Every kernel entry point as a torch operator, genq::<name>, registered
with torch.library.custom_op.

An operator is what FakeTensorMode, torch.compile and CUDA graph capture can
see: its schema says which arguments it writes in place (mutates_args: the
caches of write_kv, q and k of apply_rope), and its fake function gives the
outputs' shape, dtype and device from metadata alone, never touching data,
so a model runs on fake CUDA tensors without a GPU. The real implementation
is picked per call by kernels/dispatch.py's rule: the Triton kernel on CUDA
(or GENQ_FORCE_TRITON=1), else the torch reference, unchanged.

custom_op and not triton_op: the implementations are opaque on purpose.
The CPU reference syncs with the host (.tolist() of the sequence lengths),
and the Triton wrappers pick formats and tiles from tensor metadata in
Python; a compiled graph calls each operator as one node instead of tracing
into either.

No autograd formula is registered: the engine runs inference only (a
backward through an operator raises).

rms_norm with a residual returns two tensors and without it one, so it is
two operators: genq::rms_norm and genq::add_rms_norm (kernels.rms_norm
picks). Every operator checks that its tensors share the first one's
device (ValueError naming the argument), in the fake function too, and the
fake functions check what else the real ones would reject from metadata
(cache formats and scales, head grouping, the gate/up width).
"""

from __future__ import annotations

import torch
from torch import Tensor

from kernels import reference
from kernels.dispatch import check_devices, dispatched
from kernels.kv_quant import paged_formats

_rms_norm_impl = dispatched(reference.rms_norm)
_silu_and_mul_impl = dispatched(reference.silu_and_mul)
_gelu_tanh_and_mul_impl = dispatched(reference.gelu_tanh_and_mul)
_apply_rope_impl = dispatched(reference.apply_rope)
_write_kv_impl = dispatched(reference.write_kv)
_paged_attention_impl = dispatched(reference.paged_attention)


def _norm_dtype(x: Tensor, weight: Tensor, unit_offset: bool) -> torch.dtype:
    """The normed output's dtype: x's for Gemma's (1 + weight) in fp32, else weight * x's."""
    return x.dtype if unit_offset else torch.result_type(weight, x)


# --------------------------------------------------------------------------- RMSNorm


@torch.library.custom_op("genq::rms_norm", mutates_args=())
def _rms_norm(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    check_devices("rms_norm", "x", x, weight=weight)
    return _rms_norm_impl(x, weight, eps, None, unit_offset)[0]


@_rms_norm.register_fake
def _rms_norm_fake(x: Tensor, weight: Tensor, eps: float, unit_offset: bool = False) -> Tensor:
    check_devices("rms_norm", "x", x, weight=weight)
    return x.new_empty(x.shape, dtype=_norm_dtype(x, weight, unit_offset))


@torch.library.custom_op("genq::add_rms_norm", mutates_args=())
def _add_rms_norm(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, unit_offset: bool = False
) -> tuple[Tensor, Tensor]:
    check_devices("add_rms_norm", "x", x, residual=residual, weight=weight)
    out, summed = _rms_norm_impl(x, weight, eps, residual, unit_offset)
    assert summed is not None
    return out, summed


@_add_rms_norm.register_fake
def _add_rms_norm_fake(
    x: Tensor, residual: Tensor, weight: Tensor, eps: float, unit_offset: bool = False
) -> tuple[Tensor, Tensor]:
    check_devices("add_rms_norm", "x", x, residual=residual, weight=weight)
    return x.new_empty(x.shape, dtype=_norm_dtype(x, weight, unit_offset)), x.new_empty(x.shape)


# --------------------------------------------------------------------------- activation * mul


def _gated_shape(op: str, gate_up: Tensor) -> tuple[int, ...]:
    """The output shape [..., I] of a fused [..., 2 * I] gate/up input."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"genq::{op}: gate_up's last dim must be even (gate then up), got {width}")
    return (*gate_up.shape[:-1], width // 2)


@torch.library.custom_op("genq::silu_and_mul", mutates_args=())
def _silu_and_mul(gate_up: Tensor) -> Tensor:
    _gated_shape("silu_and_mul", gate_up)
    return _silu_and_mul_impl(gate_up)


@_silu_and_mul.register_fake
def _silu_and_mul_fake(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty(_gated_shape("silu_and_mul", gate_up))


@torch.library.custom_op("genq::gelu_tanh_and_mul", mutates_args=())
def _gelu_tanh_and_mul(gate_up: Tensor) -> Tensor:
    _gated_shape("gelu_tanh_and_mul", gate_up)
    return _gelu_tanh_and_mul_impl(gate_up)


@_gelu_tanh_and_mul.register_fake
def _gelu_tanh_and_mul_fake(gate_up: Tensor) -> Tensor:
    return gate_up.new_empty(_gated_shape("gelu_tanh_and_mul", gate_up))


# --------------------------------------------------------------------------- RoPE


@torch.library.custom_op("genq::apply_rope", mutates_args=("q", "k"))
def _apply_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    check_devices("apply_rope", "q", q, k=k, cos=cos, sin=sin)
    _apply_rope_impl(q, k, cos, sin)


@_apply_rope.register_fake
def _apply_rope_fake(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
    check_devices("apply_rope", "q", q, k=k, cos=cos, sin=sin)


# --------------------------------------------------------------------------- KV write


@torch.library.custom_op("genq::write_kv", mutates_args=("k_cache", "v_cache", "k_scales", "v_scales"))
def _write_kv(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scales: Tensor | None,
    v_scales: Tensor | None,
) -> None:
    check_devices("write_kv", "k", k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                  k_scales=k_scales, v_scales=v_scales)
    _write_kv_impl(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)


@_write_kv.register_fake
def _write_kv_fake(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    k_scales: Tensor | None,
    v_scales: Tensor | None,
) -> None:
    check_devices("write_kv", "k", k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                  k_scales=k_scales, v_scales=v_scales)
    paged_formats(k_cache, v_cache, k_scales, v_scales, k.shape[-1])


# --------------------------------------------------------------------------- paged attention


def _check_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    k_scales: Tensor | None,
    v_scales: Tensor | None,
) -> None:
    check_devices("paged_attention", "q", q, k_cache=k_cache, v_cache=v_cache, page_table=page_table,
                  cu_seqlens_q=cu_seqlens_q, context_lens=context_lens, k_scales=k_scales, v_scales=v_scales)
    if q.shape[1] % k_cache.shape[0]:
        raise ValueError(f"genq::paged_attention: {q.shape[1]} query heads do not group over "
                         f"{k_cache.shape[0]} KV heads")


@torch.library.custom_op("genq::paged_attention", mutates_args=())
def _paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> Tensor:
    _check_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, context_lens, k_scales, v_scales)
    return _paged_attention_impl(q, k_cache, v_cache, page_table, cu_seqlens_q, context_lens, scale,
                                 sliding_window, softcap, k_scales, v_scales)


@_paged_attention.register_fake
def _paged_attention_fake(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    page_table: Tensor,
    cu_seqlens_q: Tensor,
    context_lens: Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scales: Tensor | None = None,
    v_scales: Tensor | None = None,
) -> Tensor:
    _check_attention(q, k_cache, v_cache, page_table, cu_seqlens_q, context_lens, k_scales, v_scales)
    paged_formats(k_cache, v_cache, k_scales, v_scales, q.shape[-1])
    return torch.empty_like(q)


# The operators' handles (torch.ops.genq.<name>.default), which kernels/__init__.py's entry points call.
rms_norm = torch.ops.genq.rms_norm.default
add_rms_norm = torch.ops.genq.add_rms_norm.default
silu_and_mul = torch.ops.genq.silu_and_mul.default
gelu_tanh_and_mul = torch.ops.genq.gelu_tanh_and_mul.default
apply_rope = torch.ops.genq.apply_rope.default
write_kv = torch.ops.genq.write_kv.default
paged_attention = torch.ops.genq.paged_attention.default
