"""The generator's named adapters (drawn after vLLM's LoRA manager): registered and unregistered
between iterate() calls, resolved once per job at enqueue.

A job holds the adapter it was admitted with: unregistering a name refuses new jobs for it at
once, while jobs already queued or running finish with the weights they started with (their
memory is freed when the last of them ends). A name registered again later, even with other
weights, never mixes into those jobs, and its pages are named by content (LoraAdapter.digest).

Residency (vLLM's --max-loras with its LRU cache of CPU LoRAs): at most `max_loras` registered
adapters keep their tensors on the engine's device (None: no bound). Naming an offloaded adapter
brings it back, first moving the least recently used resident adapter that no live job holds to
host memory; when every resident adapter is held, enqueue raises AdaptersBusy and the caller keeps
the job waiting (as vLLM's scheduler leaves it in its waiting queue) until one of them ends. On a
CPU engine the move is a no-op but the accounting is the same."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.errors import AdapterLoadError, AdaptersBusy, JobRejected
from engine.lora.adapter import LoraAdapter
from engine.lora.loading import load_adapter
from engine.lora.slots import LoraSlots


class AdapterRegistry:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 held: Callable[[], set[int]] = set, slots: LoraSlots | None = None) -> None:
        """held(): the ids of the adapters live jobs hold (never evicted); slots: the stacked
        weights of the steps' batched product, whose slot an offloaded adapter gives up."""
        self.config, self.dtype, self.device = config, dtype, device
        self.max_loras: int | None = None
        self.evictions = 0
        self._held = held
        self._slots = slots
        self._adapters: dict[str, LoraAdapter] = {}
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first

    def register(self, name: str, path: str | Path) -> LoraAdapter:
        """Load the adapter directory at `path` under `name` (AdapterLoadError if refused, or if
        the name is taken: unregister it first)."""
        if not isinstance(name, str) or not name:
            raise AdapterLoadError(f"an adapter name must be a non-empty string, got {name!r}")
        if name in self._adapters:
            raise AdapterLoadError(f"adapter {name!r} is already registered; unregister it first")
        adapter = load_adapter(path, self.config, name, self.dtype, self.device)
        self._adapters[name] = adapter
        if self._make_room(set()):
            self._resident[name] = None
        else:
            self._offload(adapter)
        return adapter

    def unregister(self, name: str) -> None:
        """Refuse new jobs for `name`; its queued and running jobs finish with it (KeyError if unknown)."""
        if name not in self._adapters:
            raise KeyError(f"no adapter {name!r} is registered")
        del self._adapters[name]
        self._resident.pop(name, None)

    def resolve(self, name: str | None, holding: set[int] | None = None) -> LoraAdapter | None:
        """The adapter a job names (None: the base model), resident on the device and now the most
        recently used; JobRejected if none is registered so, AdaptersBusy if it is offloaded and
        every resident slot is held. `holding`: ids of adapters jobs being enqueued with this one hold."""
        if name is None:
            return None
        adapter = self._adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self._adapters)) or "none"
            raise JobRejected(f"adapter {name!r} is not registered (registered: {known})")
        if name not in self._resident:
            if not self._make_room(holding or set()):
                raise AdaptersBusy(f"adapter {name!r} waits for a resident slot: all max_loras={self.max_loras} "
                                   "are held by running jobs")
            adapter.load_to(self.device)
        self._resident[name] = None
        self._resident.move_to_end(name)
        return adapter

    def _make_room(self, holding: set[int]) -> bool:
        """Whether one more adapter may be resident, after offloading the least recently used one no
        live job holds if the bound is reached."""
        if self.max_loras is None or len(self._resident) < self.max_loras:
            return True
        held = self._held() | holding
        for name in self._resident:
            adapter = self._adapters[name]
            if id(adapter) not in held:
                del self._resident[name]
                self._offload(adapter)
                self.evictions += 1
                return True
        return False

    def _offload(self, adapter: LoraAdapter) -> None:
        """Move the adapter to host memory, its stacked copy (if any) freed with it."""
        if self._slots is not None:
            self._slots.release(adapter)
        adapter.offload()

    def resident(self) -> list[str]:
        """The registered adapters whose tensors are on the device, least recently used first."""
        return list(self._resident)

    def names(self) -> list[str]:
        return sorted(self._adapters)

    def __contains__(self, name: object) -> bool:
        return name in self._adapters

    def __len__(self) -> int:
        return len(self._adapters)
