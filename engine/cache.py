"""Paged KV cache: the K/V tensors and the pool that hands out their pages.

Pages are fixed-size blocks of token slots. A sequence owns a page table (a
list of page indices); pages are allocated on demand as it grows and carry a
reference count so that several sequences can share one.

Prefix dedup: a full page is named by a chained hash of its content
(parent page's hash, its token ids, extra keys such as embedding ids), so
equal hashes mean equal prefixes up to and including that page. A page whose
count drops to zero keeps its contents and its hash, parked in LRU order;
a later sequence with the same prefix revives it instead of recomputing, and
fresh allocations take never-hashed pages first, then evict the least
recently used parked page.

The hash is BLAKE2b-128 over the parent digest and the page's tokens. Two
different prefixes collide with probability about n^2 / 2^129 for n pages
ever hashed — below 1e-20 for a trillion pages — so a hit is trusted without
comparing tokens (the same argument content-addressed stores make).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kernels
from engine.config import ModelConfig

ROOT_HASH = b""


def page_hash(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    """Content name of a full page: its tokens, everything before it (parent), extra keys."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    digest.update(extra)
    return digest.digest()


class OutOfPages(RuntimeError):
    """The pool has fewer free pages than asked for; the scheduler preempts."""


class PagePool:
    """Reference counts, a free list, and the prefix cache of parked pages."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.ref_counts = [0] * num_pages
        self.page_hashes: list[bytes | None] = [None] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._parked: OrderedDict[int, None] = OrderedDict()
        self._by_hash: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Pages an allocation can take: empty ones plus parked (evictable) ones."""
        return len(self._free) + len(self._parked)

    @property
    def num_cached(self) -> int:
        """Unreferenced pages kept for their contents."""
        return len(self._parked)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfPages(f"asked for {count} pages, {self.num_free} free")
        pages = []
        for _ in range(count):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._parked.popitem(last=False)
                self._forget(page)
            self.ref_counts[page] = 1
            pages.append(page)
        return pages

    def retain(self, pages: list[int]) -> None:
        for page in pages:
            if self.ref_counts[page] == 0:
                del self._parked[page]
            self.ref_counts[page] += 1

    def release(self, pages: list[int]) -> None:
        for page in pages:
            count = self.ref_counts[page]
            if count <= 0:
                raise RuntimeError(f"page {page} released more often than it was referenced")
            self.ref_counts[page] = count - 1
            if count == 1:
                if self.page_hashes[page] is None:
                    self._free.append(page)
                else:
                    self._parked[page] = None

    def lookup(self, digest: bytes) -> int | None:
        return self._by_hash.get(digest)

    def is_parked(self, page: int) -> bool:
        return page in self._parked

    def register(self, page: int, digest: bytes) -> None:
        """Name a page that holds (or will hold, by the end of this step) the
        content `digest`. A duplicate of an already-named page stays anonymous."""
        if self.page_hashes[page] is None and digest not in self._by_hash:
            self.page_hashes[page] = digest
            self._by_hash[digest] = page

    def _forget(self, page: int) -> None:
        digest = self.page_hashes[page]
        if digest is not None:
            del self._by_hash[digest]
            self.page_hashes[page] = None


@dataclass
class KVCache:
    """Per-layer K and V pages: k and v are [layers, kv_heads, pages, page_size, X]
    (the layout kernels/ works on), X = head_dim, or head_dim / 2 for the packed q4 format.

    cache_dtype picks the storage (kernels.KV_CACHE_DTYPES): "auto" keeps the model's dtype;
    "fp8", "q8", "q4" and "k8v4" (keys at 8 bits, values at 4) store K/V quantized when
    written, with float16 scales per group of a token's head vector (k_scales / v_scales,
    [layers, kv_heads, pages, page_size, groups]), and paged attention dequantizes only the
    pages it reads. Halving or quartering bytes per token is
    what lets a GPU keep two to four times the concurrent context of a full-precision cache.
    """

    k: torch.Tensor
    v: torch.Tensor
    page_size: int
    k_scales: torch.Tensor | None = None
    v_scales: torch.Tensor | None = None
    cache_dtype: str = "auto"

    @property
    def num_pages(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype, cache_dtype: str = "auto") -> int:
        """Bytes one token's K and V take over all layers, scales included."""
        layout = kernels.kv_cache_format(cache_dtype, config.head_dim, dtype)
        return config.num_layers * config.num_kv_heads * layout.bytes_per_head_token

    @classmethod
    def allocate(
        cls, config: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str,
        cache_dtype: str = "auto",
    ) -> KVCache:
        """A zeroed cache; dtype is the model's, cache_dtype the storage format (ValueError naming
        the allowed formats for an unknown one)."""
        layout = kernels.kv_cache_format(cache_dtype, config.head_dim, dtype)
        shape = (config.num_layers, config.num_kv_heads, num_pages, page_size)

        def data(fmt: kernels.KVFormat) -> torch.Tensor:
            return torch.zeros((*shape, fmt.data_dim), dtype=fmt.data_dtype, device=device)

        def scales(fmt: kernels.KVFormat) -> torch.Tensor | None:
            if not fmt.scale_groups:
                return None
            return torch.ones((*shape, fmt.scale_groups), dtype=torch.float16, device=device)

        return cls(k=data(layout.k), v=data(layout.v), page_size=page_size, k_scales=scales(layout.k),
                   v_scales=scales(layout.v), cache_dtype=layout.name)
