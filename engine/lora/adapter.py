"""A loaded LoRA adapter: per fused linear of each layer, the A and B the batched product uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LinearKey = tuple[int, str]
"""(layer index, the engine's fused linear: qkv_proj, o_proj, gate_up_proj or down_proj)."""


@dataclass(frozen=True)
class LoraSlice:
    """One targeted module of a fused linear: which output slice it is (its index among the
    linear's slices, its first output column and width) and its rank. The stacked slots expand
    per slice (engine/lora/slots.py), so they skip the zero blocks of the placed B."""

    index: int
    start: int
    width: int
    rank: int


@dataclass(frozen=True, eq=False)
class LoraAdapter:
    """weights[(layer, linear)] = (A [R, in], B [out, R]): the adapter's A matrices of that fused
    linear stacked on the rank axis, and its B matrices placed block-diagonally at their output
    slices, each scaled by its module's PEFT scaling, so out += (x @ A^T) @ B^T adds every targeted
    slice's delta at once (zeros elsewhere add exactly nothing).

    digest names the adapter's content (its config and tensor file): it roots the prefix-page hash
    chain of the adapter's jobs, so their pages are shared with each other and never with another
    adapter's or the base model's, whatever name the adapter is registered under.
    scalings[module] is the PEFT scaling of each targeted module, by PEFT's module name.
    slices[(layer, linear)]: the targeted modules of that linear in the order of A's rank axis."""

    name: str
    digest: bytes
    rank: int
    weights: dict[LinearKey, tuple[torch.Tensor, torch.Tensor]]
    scalings: dict[str, float]
    slices: dict[LinearKey, tuple[LoraSlice, ...]]

    @property
    def device(self) -> torch.device:
        """Where the adapter's tensors are now (host memory once offloaded)."""
        return next(iter(self.weights.values()))[0].device

    def load_to(self, device: torch.device) -> None:
        """Move every tensor to `device` (a no-op move when they are there): the registry brings an
        offloaded adapter back when a job names it. Only between steps, and never while a job holds it."""
        for key, (a, b) in self.weights.items():
            self.weights[key] = (a.to(device), b.to(device))

    def offload(self) -> None:
        """Move every tensor to host memory (the registry's least-recently-used eviction)."""
        self.load_to(torch.device("cpu"))

    @property
    def num_bytes(self) -> int:
        """Device memory the adapter's tensors take."""
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)

    def __repr__(self) -> str:
        return f"LoraAdapter(name={self.name!r}, rank={self.rank}, linears={len(self.weights)})"
