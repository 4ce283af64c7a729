"""The grouped LoRA product: out[tokens] += (x[tokens] @ A^T) @ B^T, in place, for one adapter's
group of a batch's tokens (Punica's / S-LoRA's segmented gather-matmul: the engine calls it once
per adapter present in the step, engine/lora/batch.py).

lora_add is the torch operator genq::lora_add (it writes `out` in place; a fake function checks
shapes from metadata, for FakeTensorMode, torch.compile and CUDA graphs), its implementation
picked as every kernel's is (kernels/dispatch.py): the Triton kernel (kernels/triton_lora.py) for
CUDA tensors or GENQ_FORCE_TRITON=1 (Triton's interpreter on CPU tensors); otherwise the torch
reference below, which is also the oracle the Triton kernel is checked against.

lora_add_segments_reference is the CPU path for adapters over stacked slots: every group's tokens
in one padded [groups, rows, in] layout against the groups' stacked weights (engine/lora/slots.py),
one torch.bmm shrink and one expand per output slice instead of a product per adapter (a small
model's step pays per call for each adapter; with many adapters the weights read dominate, so the
expand skips a fused B's zero blocks)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.dispatch import check_devices, dispatched, triton_enabled


def lora_add_reference(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       tokens: torch.Tensor) -> None:
    """out [T, N] += the delta of the rows `tokens` [G] of x [T, K] through A [R, K] and B [N, R]:
    gather, shrink to rank R, expand to N, scatter-add (the rows are distinct)."""
    delta = (x.index_select(0, tokens) @ a.t()) @ b.t()
    out.index_add_(0, tokens, delta.to(out.dtype))


class Scratch:
    """The delta buffer lora_add_segments_reference reuses from one fused linear and one step to the
    next: a fresh tensor of a prefill's size costs its page faults on this CPU, more than the
    product. One product at a time uses it."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, int, int], like: torch.Tensor) -> torch.Tensor:
        """An uninitialised [shape] tensor of like's dtype and device."""
        numel = shape[0] * shape[1] * shape[2]
        buffer = self._buffer
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = self._buffer = like.new_empty(numel)
        return buffer[:numel].view(shape)


def lora_add_segments_reference(out: torch.Tensor, x: torch.Tensor, a_t: torch.Tensor,
                                slices: Sequence[tuple[int, int, torch.Tensor]], gather: torch.Tensor | None,
                                valid: torch.Tensor | None, tokens: torch.Tensor | None, scratch: Scratch) -> None:
    """out [T, N] += every group's delta at once: A^T [G, K, C] the groups' shrink weights, and per
    output slice (its first out column, its first column of A^T, B^T [G, R, W]); gather [G * M]
    the x row of each of the G groups' M padded positions (None: x itself is the one group's
    rows, in order), valid the positions that are real rows (None: all are) and tokens [V] the
    out row of each (distinct rows; None: out's rows in order)."""
    segments = x.unsqueeze(0) if gather is None else x.index_select(0, gather).view(a_t.shape[0], -1, x.shape[1])
    shrunk = torch.bmm(segments, a_t)
    if len(slices) == 1 and slices[0][2].shape[2] == out.shape[1]:
        delta = torch.bmm(shrunk, slices[0][2])
    else:  # each slice's expand written into its columns of one delta
        delta = scratch.take((shrunk.shape[0], shrunk.shape[1], out.shape[1]), x)
        if sum(b_t.shape[2] for _, _, b_t in slices) < out.shape[1]:
            delta.zero_()  # the columns of slices no slotted adapter targets
        for start, column, b_t in slices:
            torch.bmm(shrunk[:, :, column : column + b_t.shape[1]], b_t, out=delta[:, :, start : start + b_t.shape[2]])
    rows = delta.view(-1, out.shape[1])
    if valid is not None:
        rows = rows.index_select(0, valid)
    if tokens is None:
        out.add_(rows.to(out.dtype))
    else:
        out.index_add_(0, tokens, rows.to(out.dtype))


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
