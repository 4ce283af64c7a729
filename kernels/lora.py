"""The grouped LoRA product: out[tokens] += (x[tokens] @ A^T) @ B^T, in place, for one adapter's
group of a batch's tokens (Punica's / S-LoRA's segmented gather-matmul: the engine calls it once
per adapter present in the step, engine/lora/batch.py).

lora_add is the torch operator genq::lora_add (it writes `out` in place; a fake function checks
shapes from metadata, for FakeTensorMode, torch.compile and CUDA graphs), its implementation
picked as every kernel's is (kernels/dispatch.py): the Triton kernel (kernels/triton_lora.py) for
CUDA tensors or GENQ_FORCE_TRITON=1 (Triton's interpreter on CPU tensors); otherwise the torch
reference below, which is also the oracle the Triton kernel is checked against.

lora_add_segments_reference is the CPU path for many adapters at once: every group's tokens in one
padded [groups, rows, in] layout against the groups' stacked weights (engine/lora/slots.py), two
torch.bmm instead of a product per adapter (the per-call overhead, not the arithmetic, is what a
small model's step pays for each adapter)."""

from __future__ import annotations

import torch

from kernels.dispatch import check_devices, dispatched, triton_enabled


def lora_add_reference(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       tokens: torch.Tensor) -> None:
    """out [T, N] += the delta of the rows `tokens` [G] of x [T, K] through A [R, K] and B [N, R]:
    gather, shrink to rank R, expand to N, scatter-add (the rows are distinct)."""
    delta = (x.index_select(0, tokens) @ a.t()) @ b.t()
    out.index_add_(0, tokens, delta.to(out.dtype))


def lora_add_segments_reference(out: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor, b_t: torch.Tensor,
                                gather: torch.Tensor, valid: torch.Tensor | None, tokens: torch.Tensor) -> None:
    """out [T, N] += every group's delta at once: A^T [G, K, R] and B^T [G, R, N] the groups' weights,
    gather [G * M] the x row of each of the G groups' M padded positions, valid the positions
    that are real rows (None: all are) and tokens [V] the out row of each (distinct rows)."""
    segments = x.index_select(0, gather).view(a_t.shape[0], -1, x.shape[1])
    delta = torch.bmm(torch.bmm(segments, a_t), b_t).view(-1, b_t.shape[2])
    if valid is not None:
        delta = delta.index_select(0, valid)
    out.index_add_(0, tokens, delta.to(out.dtype))


_lora_add_impl = dispatched(lora_add_reference, "triton_lora", "lora_add")


def _check(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor) -> None:
    """What the real and the fake operator reject from metadata."""
    check_devices("lora_add", "x", x, out=out, a=a, b=b, tokens=tokens)
    if a.shape[1] != x.shape[1] or b.shape[1] != a.shape[0] or b.shape[0] != out.shape[1] \
            or out.shape[0] != x.shape[0]:
        raise ValueError(f"genq::lora_add: x {tuple(x.shape)}, A {tuple(a.shape)}, B {tuple(b.shape)} and out "
                         f"{tuple(out.shape)} do not chain")


@torch.library.custom_op("genq::lora_add", mutates_args=("out",))
def _lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor) -> None:
    _check(out, x, a, b, tokens)
    _lora_add_impl(out, x, a, b, tokens)


@_lora_add.register_fake
def _lora_add_fake(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   tokens: torch.Tensor) -> None:
    _check(out, x, a, b, tokens)


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, tokens: torch.Tensor) -> None:
    """out[tokens] += (x[tokens] @ A^T) @ B^T in place: genq::lora_add on the Triton path, the reference
    directly for real CPU tensors (kernels/__init__.py says why)."""
    if not triton_enabled(out):
        lora_add_reference(out, x, a, b, tokens)
        return
    torch.ops.genq.lora_add.default(out, x, a, b, tokens)
