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

Each operator is one row below: its schema string (the one declaration of
its arguments, as a C++ extension declares its ops), the implementation, the
fake function and the checks both run (kernels/dispatch.py's register).

rms_norm with a residual returns two tensors and without it one, so it is
two operators: genq::rms_norm and genq::add_rms_norm (kernels.rms_norm
picks). Every operator checks that its tensors share the first one's
device (ValueError naming the argument), in the fake function too, and the
fake functions check what else the real ones would reject from metadata
(cache formats and scales, head grouping, the gate/up width).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from kernels import reference
from kernels.dispatch import dispatched, register
from kernels.kv_quant import paged_formats

_rms_norm_impl = dispatched(reference.rms_norm)


def _norm_like(x: Tensor, weight: Tensor, unit_offset: bool) -> Tensor:
    """The normed output from metadata: x's dtype for Gemma's (1 + weight) in fp32, else weight * x's."""
    return x.new_empty(x.shape, dtype=x.dtype if unit_offset else torch.result_type(weight, x))


def _gated_shape(op: str, gate_up: Tensor) -> tuple[int, ...]:
    """The output shape [..., I] of a fused [..., 2 * I] gate/up input."""
    width = gate_up.shape[-1]
    if width % 2:
        raise ValueError(f"genq::{op}: gate_up's last dim must be even (gate then up), got {width}")
    return (*gate_up.shape[:-1], width // 2)


def _gated(name: str) -> torch._ops.OpOverload:
    """genq::<name>, an activation of a fused gate/up projection times its up half."""
    return register(f"{name}(Tensor gate_up) -> Tensor", dispatched(getattr(reference, name)),
                    lambda gate_up: gate_up.new_empty(_gated_shape(name, gate_up)),
                    lambda gate_up: _gated_shape(name, gate_up))


def _write_kv_fake(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor,
                   k_scales: Tensor | None, v_scales: Tensor | None) -> None:
    """The caches' formats and scales, which the implementations check for themselves."""
    paged_formats(k_cache, v_cache, k_scales, v_scales, k.shape[-1])


def _check_attention(q: Tensor, k_cache: Tensor, *_: object) -> None:
    """The query heads must group evenly over the KV heads (GQA)."""
    if q.shape[1] % k_cache.shape[0]:
        raise ValueError(f"genq::paged_attention: {q.shape[1]} query heads do not group over "
                         f"{k_cache.shape[0]} KV heads")


def _paged_attention_fake(q: Tensor, k_cache: Tensor, v_cache: Tensor, *rest: Any) -> Tensor:
    """The caches' formats and scales (the last two arguments), then the output: q's shape."""
    k_scales, v_scales = rest[-2:]
    paged_formats(k_cache, v_cache, k_scales, v_scales, q.shape[-1])
    return torch.empty_like(q)


# The operators' handles (torch.ops.genq.<name>.default), which kernels/__init__.py's entry points call.
rms_norm = register(
    "rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset=False) -> Tensor",
    lambda x, weight, eps, unit_offset: _rms_norm_impl(x, weight, eps, None, unit_offset)[0],
    lambda x, weight, eps, unit_offset: _norm_like(x, weight, unit_offset))
add_rms_norm = register(
    "add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool unit_offset=False) -> (Tensor, Tensor)",
    lambda x, residual, weight, eps, unit_offset: _rms_norm_impl(x, weight, eps, residual, unit_offset),
    lambda x, residual, weight, eps, unit_offset: (_norm_like(x, weight, unit_offset), x.new_empty(x.shape)))
silu_and_mul = _gated("silu_and_mul")
gelu_tanh_and_mul = _gated("gelu_tanh_and_mul")
apply_rope = register("apply_rope(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()",
                      dispatched(reference.apply_rope), lambda *_: None)
write_kv = register(
    "write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
    "Tensor(c!)? k_scales, Tensor(d!)? v_scales) -> ()",
    dispatched(reference.write_kv), _write_kv_fake)
paged_attention = register(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor page_table, Tensor cu_seqlens_q, "
    "Tensor context_lens, float scale, SymInt? sliding_window=None, float? softcap=None, Tensor? k_scales=None, "
    "Tensor? v_scales=None) -> Tensor",
    dispatched(reference.paged_attention), _paged_attention_fake, _check_attention)
