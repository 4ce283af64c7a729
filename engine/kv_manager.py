"""The KV-cache manager: which physical pages each sequence holds, and why.

The scheduler decides who runs (policy); this module owns the mechanism it
decides over, as nano-vllm's block manager and vLLM's KVCacheManager do:
page allocation and reference counts (through the PagePool), the chain of
full-page hashes, prefix lookup, naming pages for the prefix cache, giving
back pages that rejected draft tokens used, and, for sliding-window models,
pages that fell out of the window.

Sliding window. When every layer of every model sharing the page tables
attends only to the last W positions (Mistral-style), a key at position p is
never read again once the next query position q satisfies p <= q - W. A
page whose last position is that old is released at once (parked in the
prefix cache if it was named, else freed); its entry in the sequence's page
table becomes HOLE, which the batch builder maps to any valid page because
the attention mask never reads it. For the prefix cache this means:
- released pages keep their names, so a later identical prompt still finds
  them while they are parked;
- a prefix hit no longer needs the whole chain from the first page: a cached
  prefix of n pages is usable when the pages its next query can see (the last
  ceil(W / page_size) or so) are all held, whatever happened to the older ones.
  The hash of page k covers every token before it, so a hit on k still means
  the whole prefix is equal; only the pages nobody will read may be missing.
A model that mixes windowed and global layers (Gemma 2/3) keeps every page.

A cached prefix never ends inside a bidirectional span (Gemma 3's images:
engine/embeddings.py): the span's positions are computed together, so a hit
stops at the last page boundary before it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.cache import ROOT_HASH, PagePool, page_hash
from engine.embeddings import span_containing
from engine.sequence import Sequence

#: A page-table entry whose page was released (outside the sliding window).
HOLE = -1


def _hit(page: int | None) -> int:
    """A lookup's page where the prefix needs one: pages [first needed, best) of
    cached_prefix() lie in one run of hits."""
    assert page is not None, "a needed page of a cached prefix missed the cache"
    return page


@dataclass(frozen=True)
class CachedPrefix:
    """A lookup result: page-table entries (HOLE where not needed) for the first
    len(pages) pages, of which num_parked must be revived from the LRU."""

    pages: tuple[int, ...]
    num_parked: int

    @property
    def num_held(self) -> int:
        return sum(1 for page in self.pages if page != HOLE)


class KVManager:
    def __init__(
        self, num_pages: int, page_size: int, prefix_caching: bool = True, sliding_window: int | None = None
    ) -> None:
        """sliding_window: the window every layer of every model on these pages
        uses (None when any layer attends globally): pages older than it are released."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.pool = PagePool(num_pages)
        self.page_size = page_size
        self.prefix_caching = prefix_caching
        self.sliding_window = sliding_window

    @property
    def num_free(self) -> int:
        return self.pool.num_free

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def first_needed_page(self, next_position: int) -> int:
        """The oldest page a query at next_position or later can still attend to."""
        if self.sliding_window is None:
            return 0
        return max(0, next_position - self.sliding_window + 1) // self.page_size

    # -- prefix cache ------------------------------------------------------

    def cached_prefix(self, sequence: Sequence) -> CachedPrefix:
        """The longest run of the sequence's leading full pages the cache can
        serve; the page with its last token is never taken (its logits are needed),
        nor any page of a prompt whose every position is scored (Sequence.scores_prompt), and it never
        ends inside a bidirectional span."""
        if not self.prefix_caching or sequence.scores_prompt:
            return CachedPrefix((), 0)
        usable = (len(sequence.token_ids) - 1) // self.page_size
        self._hash_pages(sequence, usable)
        found: list[int | None] = []
        best, run_start = 0, 0
        spans = sequence.job.bidirectional_spans
        for k, digest in enumerate(sequence.page_hashes[:usable]):
            page = self.pool.lookup(digest)
            found.append(page)
            if page is None:
                if self.sliding_window is None:
                    break
                run_start = k + 1
            elif (run_start <= self.first_needed_page((k + 1) * self.page_size)
                  and span_containing(spans, (k + 1) * self.page_size) is None):
                best = k + 1
        first = self.first_needed_page(best * self.page_size)
        pages = tuple(HOLE if k < first else _hit(found[k]) for k in range(best))
        parked = sum(1 for page in pages if page != HOLE and self.pool.is_parked(page))
        return CachedPrefix(pages, parked)

    def _hash_pages(self, sequence: Sequence, count: int) -> None:
        """Extend the sequence's chain of full-page hashes to `count` pages."""
        size = self.page_size
        hashes = sequence.page_hashes
        tokens = sequence.token_ids
        # a LoRA adapter's content digest roots its jobs' chains: pages shared within an adapter only
        root = sequence.adapter.digest if sequence.adapter is not None else ROOT_HASH
        while len(hashes) < count:
            k = len(hashes)
            hashes.append(page_hash(hashes[-1] if hashes else root, tokens[k * size : (k + 1) * size]))

    def forget_hashes_past(self, sequence: Sequence, num_tokens: int) -> None:
        """The sequence's tokens were cut back to num_tokens: drop the hashes of pages past them."""
        del sequence.page_hashes[num_tokens // self.page_size :]

    def name_full_pages(self, sequence: Sequence, num_known: int) -> None:
        """Name (for the prefix cache) every page the first num_known tokens fill:
        called when a step that writes them is scheduled; the forward writes each
        layer's K/V before any attention reads it."""
        if not self.prefix_caching:
            return
        full = num_known // self.page_size
        if full <= sequence.registered_pages:
            return
        self._hash_pages(sequence, full)
        for k in range(sequence.registered_pages, full):
            if sequence.pages[k] != HOLE:
                self.pool.register(sequence.pages[k], sequence.page_hashes[k])
        sequence.registered_pages = full

    # -- ownership ---------------------------------------------------------

    def take_prefix(self, sequence: Sequence, prefix: CachedPrefix) -> None:
        """Give a sequence that holds no pages the cached prefix (it is computed)."""
        held = [page for page in prefix.pages if page != HOLE]
        self.pool.retain(held)
        sequence.pages = list(prefix.pages)
        sequence.page_version += 1
        sequence.registered_pages = len(prefix.pages)
        sequence.released_pages = len(prefix.pages) - len(held)
        sequence.num_computed = len(prefix.pages) * self.page_size

    def steady(self, sequence: Sequence, num_tokens: int) -> bool:
        """Whether the sequence's pages hold num_tokens tokens and those complete no page still to be
        named: a step that ends there changes none of its pages (nearly every decode step)."""
        return num_tokens <= len(sequence.pages) * self.page_size and not (
            self.prefix_caching and num_tokens // self.page_size > sequence.registered_pages)

    def pages_missing(self, sequence: Sequence, num_tokens: int) -> int:
        """Pages to allocate so the sequence has room for num_tokens tokens."""
        return max(0, self.pages_for(num_tokens) - len(sequence.pages))

    def grow(self, sequence: Sequence, num_tokens: int) -> None:
        """Allocate pages so the sequence has room for num_tokens tokens (OutOfPages if short)."""
        missing = self.pages_missing(sequence, num_tokens)
        if missing:
            sequence.pages.extend(self.pool.allocate(missing))
            sequence.page_version += 1

    def trim(self, sequence: Sequence, num_tokens: int) -> None:
        """Give back pages past num_tokens (those only rejected draft tokens used)."""
        keep = self.pages_for(num_tokens)
        if len(sequence.pages) > keep:
            self.pool.release([page for page in sequence.pages[keep:] if page != HOLE])
            del sequence.pages[keep:]
            sequence.page_version += 1

    def release_out_of_window(self, sequence: Sequence) -> None:
        """Release the pages no future query of the sequence can attend to."""
        if self.sliding_window is None:
            return
        dead = min(self.first_needed_page(sequence.num_computed), len(sequence.pages))
        pages = sequence.pages
        for k in range(sequence.released_pages, dead):
            if pages[k] != HOLE:
                self.pool.release([pages[k]])
                pages[k] = HOLE
                sequence.page_version += 1
        sequence.released_pages = max(sequence.released_pages, dead)

    def free(self, sequence: Sequence) -> None:
        """Release every page of the sequence (finished, cancelled or preempted)."""
        self.pool.release([page for page in sequence.pages if page != HOLE])
        sequence.pages = []
        sequence.page_version += 1
        sequence.registered_pages = 0
        sequence.released_pages = 0
