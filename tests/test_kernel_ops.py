"""The kernels as torch operators (kernels/ops.py, genq::<name>): on CPU each
is its torch reference, bit for bit; on fake CUDA tensors (FakeTensorMode, no
GPU) each gives outputs of the right shape, dtype and device from metadata
alone and rejects a tensor on another device by name; torch.library.opcheck
checks each schema (mutations declared), fake function and registration
against the real implementation; and the kernels.* entry points the engine
calls go through the operators.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import kernels
from engine.quantized_linear import quantize_weight
from kernels import reference
from kernels.lora import lora_add_reference
from kernels.quant_matmul import quant_matmul, quant_matmul_reference

genq = torch.ops.genq


@dataclass
class Case:
    """One call of an operator: its args in the operator's order, the reference
    taking the same args, and the indices of the args it writes in place."""

    name: str
    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    reference: Callable[..., Any]
    mutated: tuple[int, ...] = field(default=())


def _quantized_cache(name: str, hkv: int, pages: int, page_size: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty cache of format name for K (fp8, q8) or V (q4), and ones for its scales."""
    fmt = kernels.kv_cache_format(name, d, torch.float32).k
    shape = (hkv, pages, page_size)
    return torch.zeros((*shape, fmt.data_dim), dtype=fmt.data_dtype), torch.ones((*shape, fmt.scale_groups)).half()


def _cases() -> list[Case]:
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(dtype)

    bf16 = torch.bfloat16
    x, r, w = randn(5, 64, dtype=bf16), randn(5, 64, dtype=bf16), randn(64, dtype=bf16)
    tokens, hq, hkv, d, page_size, pages = 7, 4, 2, 32, 4, 6
    cos, sin = randn(tokens, 16), randn(tokens, 16)  # partial rotary: 16 of 32 dims
    k, v, q = randn(tokens, hkv, d), randn(tokens, hkv, d), randn(tokens, hq, d)
    slots = torch.tensor([0, 1, 2, 3, 4, 9, 13])
    # one prefill row of 5 tokens (context 5) and two decodes (contexts 6 and 2)
    table = torch.tensor([[0, 1, 5], [2, 3, 4], [3, 1, 0]], dtype=torch.int32)
    cu, ctx = torch.tensor([0, 5, 6, 7], dtype=torch.int32), torch.tensor([5, 6, 2], dtype=torch.int32)
    full = randn(hkv, pages, page_size, d), randn(hkv, pages, page_size, d)
    (kq8, kq8s), (vq4, vq4s) = _quantized_cache("q8", hkv, pages, page_size, d), _quantized_cache(
        "q4", hkv, pages, page_size, d)
    fp8 = [_quantized_cache("fp8", hkv, pages, page_size, d) for _ in range(2)]
    reference.write_kv(randn(24, hkv, d), randn(24, hkv, d), kq8, vq4, torch.arange(24), kq8s, vq4s)
    reference.write_kv(randn(24, hkv, d), randn(24, hkv, d), fp8[0][0], fp8[1][0], torch.arange(24), fp8[0][1],
                       fp8[1][1])
    q4w = quantize_weight(randn(40, 64) * 0.05, "int4", 32)
    q8w = quantize_weight(randn(40, 64) * 0.05, "int8", None)
    return [
        Case("rms_norm", genq.rms_norm.default, (x, w, 1e-6, False),
             lambda *a: reference.rms_norm(a[0], a[1], a[2], None, a[3])[0]),
        Case("rms_norm unit_offset", genq.rms_norm.default, (x, w, 1e-6, True),
             lambda *a: reference.rms_norm(a[0], a[1], a[2], None, a[3])[0]),
        Case("add_rms_norm", genq.add_rms_norm.default, (x, r, w, 1e-6, False),
             lambda *a: reference.rms_norm(a[0], a[2], a[3], a[1], a[4])),
        Case("silu_and_mul", genq.silu_and_mul.default, (randn(3, 2, 2 * 48, dtype=bf16),), reference.silu_and_mul),
        Case("gelu_tanh_and_mul", genq.gelu_tanh_and_mul.default, (randn(4, 2 * 48),), reference.gelu_tanh_and_mul),
        Case("apply_rope", genq.apply_rope.default, (q.clone(), k.clone(), cos, sin), reference.apply_rope, (0, 1)),
        Case("write_kv", genq.write_kv.default, (k, v, *(c.clone() for c in full), slots, None, None),
             reference.write_kv, (2, 3)),
        Case("write_kv k8v4", genq.write_kv.default, (k, v, kq8.clone(), vq4.clone(), slots, kq8s.clone(),
                                                      vq4s.clone()), reference.write_kv, (2, 3, 5, 6)),
        Case("write_kv fp8", genq.write_kv.default, (k, v, fp8[0][0].clone(), fp8[1][0].clone(), slots,
                                                     fp8[0][1].clone(), fp8[1][1].clone()), reference.write_kv,
             (2, 3, 5, 6)),
        Case("paged_attention", genq.paged_attention.default, (q, *full, table, cu, ctx, 0.2, None, None),
             reference.paged_attention),
        Case("paged_attention window softcap", genq.paged_attention.default,
             (q, *full, table, cu, ctx, 0.2, 3, 2.0), reference.paged_attention),
        Case("paged_attention k8v4", genq.paged_attention.default,
             (q, kq8, vq4, table, cu, ctx, 0.2, None, None, kq8s, vq4s), reference.paged_attention),
        Case("paged_attention fp8", genq.paged_attention.default,
             (q.to(bf16), fp8[0][0], fp8[1][0], table, cu, ctx, 0.2, None, None, fp8[0][1], fp8[1][1]),
             reference.paged_attention),
        Case("quant_matmul int4", genq.quant_matmul.default,
             (randn(3, 64), q4w.qweight, q4w.scales, q4w.offsets, 4, q4w.group_size, randn(40)),
             quant_matmul_reference),
        Case("quant_matmul int8", genq.quant_matmul.default,
             (randn(2, 3, 64, dtype=bf16), q8w.qweight, q8w.scales, q8w.offsets, 8, q8w.group_size, None),
             quant_matmul_reference),
        Case("lora_add", genq.lora_add.default,
             (randn(6, 40), randn(6, 64), randn(8, 64), randn(40, 8), torch.tensor([4, 0, 2])), lora_add_reference,
             (0,)),
    ]


CASES = {case.name: case for case in _cases()}


def _copy(args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bytes, so that equality is bitwise (and fp8 compares at all)."""
    return x.contiguous().view(torch.uint8)


def _outputs(result: Any) -> list[torch.Tensor]:
    if result is None:
        return []
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("name", CASES)
def test_each_operator_on_cpu_is_its_reference_bit_for_bit(name: str):
    case = CASES[name]
    got_args, want_args = _copy(case.args), _copy(case.args)
    got, want = _outputs(case.op(*got_args)), _outputs(case.reference(*want_args))
    assert len(got) == len(want)
    for a, b in [*zip(got, want), *((got_args[i], want_args[i]) for i in case.mutated)]:
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(_bits(a), _bits(b)), name
    for i in case.mutated:
        assert not torch.equal(_bits(got_args[i]), _bits(case.args[i])), f"{name} did not write arg {i}"


def _on_fake_cuda(args: tuple[Any, ...], keep_on_cpu: int | None = None) -> tuple[Any, ...]:
    """args as fake CUDA tensors of the same shapes and dtypes (the one at keep_on_cpu a fake CPU one);
    call inside FakeTensorMode."""
    return tuple(
        torch.empty(a.shape, dtype=a.dtype, device="cpu" if i == keep_on_cpu else "cuda")
        if isinstance(a, torch.Tensor) else a
        for i, a in enumerate(args)
    )


@pytest.mark.parametrize("name", CASES)
def test_each_operator_on_fake_cuda_tensors_gives_outputs_of_the_real_shapes_and_dtypes(name: str):
    case = CASES[name]
    want = _outputs(case.op(*_copy(case.args)))
    with FakeTensorMode():
        args = _on_fake_cuda(case.args)
        got = _outputs(case.op(*args))
    assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in want]
    assert all(t.device.type == "cuda" for t in got)
    assert all(args[i].shape == case.args[i].shape and args[i].device.type == "cuda" for i in case.mutated)


@pytest.mark.parametrize(
    "name", [name for name, case in CASES.items() if sum(isinstance(a, torch.Tensor) for a in case.args) > 1]
)
def test_a_tensor_on_another_device_is_rejected_by_name(name: str):
    """(The last tensor argument on the CPU, the others on CUDA.)"""
    case = CASES[name]
    index = max(i for i, a in enumerate(case.args) if isinstance(a, torch.Tensor))
    arg_name = case.op._schema.arguments[index].name
    with FakeTensorMode(), pytest.raises(ValueError, match=rf"{arg_name} is on cpu but \w+ is on cuda"):
        case.op(*_on_fake_cuda(case.args, keep_on_cpu=index))


@pytest.mark.parametrize("name", CASES)
def test_opcheck(name: str):
    """Schema (each write declared), the fake function against the real outputs, and tracing with
    dynamic shapes through AOT dispatch (what torch.compile does). Not test_autograd_registration:
    the operators are inference only, with no autograd formula (a backward raises), and no input
    here requires grad, so it would check nothing."""
    case = CASES[name]
    utils = ["test_schema", "test_faketensor", "test_aot_dispatch_dynamic"]
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in case.args):
        # the schema check compares values with arithmetic CPU fp8 lacks ("mul" of Float8_e4m3fn); the same
        # schema is checked by the other write_kv / paged_attention cases
        utils.remove("test_schema")
    torch.library.opcheck(case.op, _copy(case.args), test_utils=utils)


class _Calls(TorchDispatchMode):
    """The operators called under it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def _entry_points(c: dict[str, Case]) -> list[tuple[str, Callable[[], Any]]]:
    """(operator, a call of the kernels.* function that should reach it) over the cases' arguments."""
    return [
        ("genq::rms_norm", lambda: kernels.rms_norm(*c["rms_norm"].args[:3])),
        ("genq::add_rms_norm", lambda: kernels.rms_norm(*(c["add_rms_norm"].args[i] for i in (0, 2, 3, 1)))),
        ("genq::silu_and_mul", lambda: kernels.silu_and_mul(*c["silu_and_mul"].args)),
        ("genq::gelu_tanh_and_mul", lambda: kernels.gelu_tanh_and_mul(*c["gelu_tanh_and_mul"].args)),
        ("genq::apply_rope", lambda: kernels.apply_rope(*c["apply_rope"].args)),
        ("genq::write_kv", lambda: kernels.write_kv(*c["write_kv k8v4"].args)),
        ("genq::paged_attention", lambda: kernels.paged_attention(*c["paged_attention k8v4"].args)),
        ("genq::quant_matmul", lambda: quant_matmul(*c["quant_matmul int4"].args)),
        ("genq::lora_add", lambda: kernels.lora_add(*c["lora_add"].args)),
    ]


def test_no_operator_gives_a_default_to_an_argument_it_writes():
    """torch before 2.13 drops trailing arguments equal to their defaults before bumping the version of
    each argument an operator writes, and indexes past them: write_kv with k_scales=None as a default
    raised IndexError on the first write to a full-precision cache (seen on an H200, torch 2.11)."""
    for op in {case.op for case in CASES.values()}:
        schema = op._schema
        written_with_default = [a.name for a in schema.arguments
                                if a.alias_info is not None and a.alias_info.is_write and a.has_default_value()]
        assert written_with_default == [], (schema.name, written_with_default)


def test_the_kernels_entry_points_call_the_operators_on_cuda_tensors():
    with FakeTensorMode():
        fake = {name: dataclasses.replace(case, args=_on_fake_cuda(case.args)) for name, case in CASES.items()}
        for op_name, call in _entry_points(fake):
            with _Calls() as calls:
                call()
            assert [name for name in calls.names if name.startswith("genq::")][:1] == [op_name], calls.names[:3]


def test_on_real_cpu_tensors_the_entry_points_run_the_reference_without_the_operator_dispatcher():
    """The dispatcher costs 10-20 us a call, a quarter of a batch-1 decode step on this CPU."""
    copies = {name: dataclasses.replace(case, args=_copy(case.args)) for name, case in CASES.items()}
    for op_name, call in _entry_points(copies):
        with _Calls() as calls:
            call()
        assert not [name for name in calls.names if name.startswith("genq::")], (op_name, calls.names[:3])
