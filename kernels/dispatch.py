"""Which implementation an operation runs, per call: the Triton kernel when
the tensors are on CUDA or GENQ_FORCE_TRITON=1 (on CPU tensors that means
Triton's interpreter), else the torch reference. The modules of Triton
kernels are imported only when that path is first taken. Also how an
operation becomes a torch operator (register: its schema string is its one
declaration, as a C++ extension's op registration is) and a kernels.*
function (entry_point), and the device check every operator makes, for real
and fake tensors alike."""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, ParamSpec, TypeVar, cast

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


def register(schema: str, impl: Callable[..., Any], fake: Callable[..., Any],
             check: Callable[..., object] | None = None) -> torch._ops.OpOverload:
    """Defines genq::<schema> ("name(args) -> outputs"; `Tensor(a!)` marks an argument it writes) and
    returns its handle. The real function runs `impl`, the fake one `fake` (the outputs from metadata
    alone), each after the same checks: every tensor on the first argument's device (ValueError naming
    the one that is not), then `check`. All three get every argument positionally, defaults filled in
    (torch may drop trailing arguments equal to their defaults)."""
    name, signature = schema.split("(", 1)
    arguments = torch._C.parse_schema(f"genq::{schema}").arguments

    def checked(run: Callable[..., Any]) -> Callable[..., Any]:
        def call(*given: Any, **named: Any) -> Any:
            values = (*given, *(named.get(a.name, a.default_value) for a in arguments[len(given):]))
            (first_name, first), *others = ((a.name, v) for a, v in zip(arguments, values)
                                             if isinstance(v, torch.Tensor))
            check_devices(name, first_name, first, **dict(others))
            if check is not None:
                check(*values)
            return run(*values)

        return call

    written = tuple(a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write)
    op = torch.library.custom_op(f"genq::{name}", checked(impl), mutates_args=written, schema=f"({signature}")
    op.register_fake(checked(fake))
    handle: torch._ops.OpOverload = getattr(torch.ops.genq, name).default
    return handle


def entry_point(reference: Callable[P, R], op: Callable[..., Any]) -> Callable[P, R]:
    """The kernels.* function of an operation: `reference` for real CPU tensors (the operator
    dispatcher costs 10-20 us a call, a quarter of a batch-1 decode step on the 2-core CPU) and for a
    call that passes an argument only the reference takes (paged_attention's bidirectional spans:
    the Triton kernel is causal only); otherwise `op` (an operator, or a function that picks one),
    given every argument it takes, with the reference's defaults for those omitted."""
    names = ([a.name for a in op._schema.arguments] if isinstance(op, torch._ops.OpOverload)
             else list(inspect.signature(op).parameters))
    parameters = inspect.signature(reference).parameters
    defaults = [parameters[name].default for name in names]

    @functools.wraps(reference)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        extra = (*args[len(names):], *(v for k, v in kwargs.items() if k not in names))
        if not triton_enabled(cast(torch.Tensor, args[0])) or any(v is not None for v in extra):
            return reference(*args, **kwargs)
        values = (*args[:len(names)], *(kwargs.get(n, d) for n, d in zip(names[len(args):], defaults[len(args):])))
        out: R = op(*values)
        return out

    return call
