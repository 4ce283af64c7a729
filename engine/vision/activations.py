"""The ungated activations of vision towers and projectors, by the names configs give them, computed as
transformers' ACT2FN computes them (kernels/ holds only the gated silu/gelu-tanh of the decoders' MLPs)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """CLIP's sigmoid approximation of GELU."""
    return x * torch.sigmoid(1.702 * x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """SigLIP's tanh approximation of GELU."""
    return F.gelu(x, approximate="tanh")


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU: LLaVA's projector."""
    return F.gelu(x)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,
    "gelu_pytorch_tanh": gelu_tanh,
    "gelu": gelu,
}
