"""What the engine asks the accelerator about itself (its memory, free and total, its compute
capability and name), in one place: engine code takes a DeviceInfo rather than calling
torch.cuda, so a caller (the GPU dry run on fake tensors, a plan for a card not present) can
supply the answers the CUDA driver would give."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeviceInfo:
    """One device: memory in bytes; capability (major, minor) for CUDA devices, None otherwise."""

    name: str
    total_memory: int
    free_memory: int
    capability: tuple[int, int] | None = None


def current(device: torch.device | str) -> DeviceInfo:
    """The CUDA driver's answers for a CUDA device; ValueError for any other (a CPU's memory is not
    the engine's to plan)."""
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"no device information for {device}: only CUDA devices are asked")
    free, total = torch.cuda.mem_get_info(device)
    return DeviceInfo(torch.cuda.get_device_name(device), total, free, torch.cuda.get_device_capability(device))
