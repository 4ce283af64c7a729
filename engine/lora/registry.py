"""The generator's named adapters (drawn after vLLM's LoRA manager): registered and unregistered
between iterate() calls, resolved once per job at enqueue.

A job holds the adapter it was admitted with: unregistering a name refuses new jobs for it at
once, while jobs already queued or running finish with the weights they started with (their
memory is freed when the last of them ends). A name registered again later, even with other
weights, never mixes into those jobs, and its pages are named by content (LoraAdapter.digest)."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import AdapterLoadError, JobRejected
from engine.lora.adapter import LoraAdapter
from engine.lora.loading import load_adapter


class AdapterRegistry:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.config, self.dtype, self.device = config, dtype, device
        self._adapters: dict[str, LoraAdapter] = {}

    def register(self, name: str, path: str | Path) -> LoraAdapter:
        """Load the adapter directory at `path` under `name` (AdapterLoadError if refused, or if
        the name is taken: unregister it first)."""
        if not isinstance(name, str) or not name:
            raise AdapterLoadError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self._adapters:
            raise AdapterLoadError(f"adapter {name!r} is already registered; unregister it first")
        adapter = load_adapter(path, self.config, name, self.dtype, self.device)
        self._adapters[name] = adapter
        return adapter

    def unregister(self, name: str) -> None:
        """Refuse new jobs for `name`; its queued and running jobs finish with it (KeyError if unknown)."""
        if name not in self._adapters:
            raise KeyError(f"no adapter {name!r} is registered")
        del self._adapters[name]

    def resolve(self, name: str | None) -> LoraAdapter | None:
        """The adapter a job names (None: the base model); JobRejected if none is registered so."""
        if name is None:
            return None
        adapter = self._adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self._adapters)) or "none"
            raise JobRejected(f"adapter {name!r} is not registered (registered: {known})")
        return adapter

    def names(self) -> list[str]:
        return sorted(self._adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)
