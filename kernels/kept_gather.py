"""Gathered K/V pages kept from one decode step to the next (the CPU reference path).

Why: the CPU paged attention copies every decoding row's pages into one
contiguous buffer per layer and step for SDPA: a quarter of a 32-job
SmolLM2-135M decode step. Between two steps a decoding row's history does not
change; only the page its new token goes to is written. A layer's cache
registered with keep_gathered() keeps the buffers of its last gather and the
page index they were gathered from; the next gather copies only the positions
whose page differs from last time's or was written since (the reference
write_kv reports every page it writes on a registered cache: wrote()). The
paged cache stays the only source of truth; the buffers are a copy checked
against its writes.

Contract: a registered cache is written by the reference write_kv only, the CPU
path (the engine's is: CausalLM.bind_cache registers each layer's K/V views of a
CPU cache, which nothing else writes; GENQ_FORCE_TRITON, which sends writes to
Triton's interpreter instead, sends the attention there too, so a process keeps
it set or unset for an engine's life).
"""

from __future__ import annotations

import weakref

import torch

#: Log entries (writes not yet seen by a gather) after which the buffers are dropped instead.
MAX_PENDING_WRITES = 64


class KeptGather:
    """One layer's K and V gathered at the last call, with the pages written since."""

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self._caches = (weakref.ref(k_cache), weakref.ref(v_cache))
        self._pages = torch.empty(0, dtype=torch.long)
        self._buffers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._written: list[torch.Tensor] = []

    def is_for(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return self._caches[0]() is k_cache and self._caches[1]() is v_cache

    def wrote(self, slots: torch.Tensor, page_size: int) -> None:
        """Record the pages holding `slots`, written into the cache this moment."""
        if len(self._written) >= MAX_PENDING_WRITES:
            self._buffers, self._written = None, []
            return
        self._written.append(torch.div(slots, page_size, rounding_mode="floor"))

    def gather(
        self, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `pages` [N] (int64), each [kv_heads, N, page_size, head_dim], views of the kept
        buffers, valid until the next gather."""
        n = pages.numel()
        buffers = self._buffers
        if buffers is None or buffers[0].shape[1] < n or buffers[0].is_inference() != torch.is_inference_mode_enabled():
            capacity = n + n // 8
            buffers = self._buffers = (_buffer(k_cache, capacity), _buffer(v_cache, capacity))
            stale = torch.ones(n, dtype=torch.bool, device=pages.device)
        else:
            common = min(n, self._pages.numel())
            stale = torch.ones(n, dtype=torch.bool, device=pages.device)
            stale[:common] = pages[:common] != self._pages[:common]
            if self._written:
                stale |= torch.isin(pages, torch.cat(self._written))
        self._pages, self._written = pages, []
        positions = stale.nonzero().squeeze(1)
        copy_all = positions.numel() == n
        out = []
        for cache, buffer in zip((k_cache, v_cache), buffers):
            kept = buffer[:, :n]
            if copy_all:
                torch.index_select(cache, 1, pages, out=kept)
            elif positions.numel():
                kept.index_copy_(1, positions, torch.index_select(cache, 1, pages[positions]))
            out.append(kept)
        return out[0], out[1]


def _buffer(cache: torch.Tensor, pages: int) -> torch.Tensor:
    return torch.empty((cache.shape[0], pages, *cache.shape[2:]), dtype=cache.dtype, device=cache.device)


_kept: dict[int, KeptGather] = {}


def keep_gathered(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Keep this layer's gathered pages between calls (see the module's contract); until the
    cache tensors are freed."""
    if lookup(k_cache, v_cache) is not None:
        return
    _kept[id(k_cache)] = KeptGather(k_cache, v_cache)
    weakref.finalize(k_cache, _kept.pop, id(k_cache), None)


def lookup(k_cache: torch.Tensor, v_cache: torch.Tensor) -> KeptGather | None:
    """The kept gather of these caches, None unless they were registered."""
    kept = _kept.get(id(k_cache))
    return kept if kept is not None and kept.is_for(k_cache, v_cache) else None
