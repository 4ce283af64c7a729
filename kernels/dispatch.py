"""Which implementation an operation runs, per call: the Triton kernel when
the tensors are on CUDA or GENQ_FORCE_TRITON=1 (on CPU tensors that means
Triton's interpreter), else the torch reference. The modules of Triton
kernels are imported only when that path is first taken. Also the device
check every operator (kernels/ops.py) makes, for real and fake tensors alike."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import ParamSpec, TypeVar, cast

import torch

FORCE_ENV = "GENQ_FORCE_TRITON"
P = ParamSpec("P")
R = TypeVar("R")


def _forced() -> bool:
    return os.environ.get(FORCE_ENV, "") not in ("", "0")


def triton_enabled(x: torch.Tensor) -> bool:
    """Whether an operation on `x` takes the Triton path."""
    return x.is_cuda or _forced()


def triton_module(x: torch.Tensor, name: str) -> ModuleType:
    """kernels.<name>, a module of Triton kernels, imported on first use: for CPU tensors in
    Triton's interpreter, which @triton.jit picks when the module is imported (triton reads
    TRITON_INTERPRET when a kernel is defined, not when triton is imported; torch imports triton
    itself when the first operator runs), so TRITON_INTERPRET=1 is set unless it was set to 0."""
    module = sys.modules.get(f"kernels.{name}")
    if module is not None:
        return module
    if not x.is_cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if os.environ["TRITON_INTERPRET"] in ("", "0"):
            raise RuntimeError(
                f"{FORCE_ENV}=1 on CPU tensors needs Triton's interpreter, but TRITON_INTERPRET is set to "
                f"{os.environ['TRITON_INTERPRET']!r}"
            )
    try:
        return importlib.import_module(f"kernels.{name}")
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            f"the Triton path was requested (CUDA tensors or {FORCE_ENV}=1) but kernels.{name} "
            f"cannot be imported: {exc}"
        ) from exc


def dispatched(op: Callable[P, R], module: str = "triton_kernels", name: str | None = None) -> Callable[P, R]:
    """The implementation for the torch reference `op`: the Triton function `name` (op's own name by
    default) of kernels.<module> when the first argument (a tensor) takes the Triton path, else op.
    The Triton function is looked up per call, so wrapping it (as tests do to count calls) is seen."""
    triton_name = name or op.__name__

    @functools.wraps(op)
    def dispatch(*args: P.args, **kwargs: P.kwargs) -> R:
        x = cast(torch.Tensor, args[0])
        impl: Callable[P, R] = getattr(triton_module(x, module), triton_name) if triton_enabled(x) else op
        return impl(*args, **kwargs)

    return dispatch


def check_devices(op: str, first: str, x: torch.Tensor, **others: torch.Tensor | None) -> None:
    """ValueError naming the argument when a tensor of `op` is not on `x`'s device (the argument
    named `first`); None arguments are absent ones. Metadata only: real and fake tensors alike."""
    for name, tensor in others.items():
        if tensor is not None and tensor.device != x.device:
            raise ValueError(f"genq::{op}: {name} is on {tensor.device} but {first} is on {x.device}")
