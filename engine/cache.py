"""Paged KV cache: the K/V tensors and the pool that hands out their pages.

Pages are fixed-size blocks of token slots. A sequence owns a page table (a
list of page indices); pages are allocated on demand as it grows and carry a
reference count so that several sequences can share one (prefix dedup builds
on this: a page whose count drops to zero may keep its contents for reuse).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.config import ModelConfig


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than asked for; the scheduler preempts."""


class PagePool:
    """Free list + reference counts over num_pages pages."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfPages(f"asked for {count} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(count)]
        for page in pages:
            self.ref_counts[page] = 1
        return pages

    def retain(self, pages: list[int]) -> None:
        for page in pages:
            self.ref_counts[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            count = self.ref_counts[page]
            if count <= 0:
                raise RuntimeError(f"page {page} released more often than it was referenced")
            self.ref_counts[page] = count - 1
            if count == 1:
                self._free.append(page)


@dataclass
class KVCache:
    """Per-layer K and V pages: k and v are [layers, kv_heads, pages, page_size, head_dim]
    (the layout kernels/ works on)."""

    k: torch.Tensor
    v: torch.Tensor
    page_size: int

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * element

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> KVCache:
        shape = (config.num_layers, config.num_kv_heads, num_pages, page_size, config.head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            page_size=page_size,
        )
