"""The KV manager on hand-built sequences: page ownership, prefix lookup, the
LRU of parked pages, draft trimming and sliding-window release."""

from __future__ import annotations

import pytest

from engine.cache import OutOfPages
from engine.kv_manager import HOLE, KVManager
from tests.kv_fixtures import make_sequence

PAGE = 4


def computed(kv: KVManager, serial: int, prompt: list[int]):
    """A sequence whose whole prompt is computed in its own fresh pages, all named."""
    sequence = make_sequence(serial, prompt)
    kv.grow(sequence, len(prompt))
    kv.name_full_pages(sequence, len(prompt))
    sequence.num_computed = len(prompt)
    return sequence


def test_grow_and_free_keep_reference_counts():
    kv = KVManager(8, PAGE, prefix_caching=False)
    a = make_sequence(0, list(range(10)))
    kv.grow(a, 10)
    assert len(a.pages) == 3 and kv.num_free == 5
    assert all(kv.pool.ref_counts[p] == 1 for p in a.pages)
    kv.grow(a, 12)
    assert len(a.pages) == 3
    kv.grow(a, 13)
    assert len(a.pages) == 4
    with pytest.raises(OutOfPages):
        kv.grow(make_sequence(1, [1]), 5 * PAGE)
    kv.free(a)
    assert a.pages == [] and kv.num_free == 8 and kv.pool.num_cached == 0


def test_prefix_lookup_shares_full_pages_but_never_the_last_token():
    kv = KVManager(16, PAGE)
    prompt = list(range(100, 112))  # exactly three pages
    a = computed(kv, 0, prompt)
    b = make_sequence(1, prompt)
    prefix = kv.cached_prefix(b)
    # the third page holds b's last token, whose logits b needs: only two pages are served
    assert prefix.pages == tuple(a.pages[:2]) and prefix.num_parked == 0
    kv.take_prefix(b, prefix)
    assert b.num_computed == 2 * PAGE
    assert [kv.pool.ref_counts[p] for p in a.pages] == [2, 2, 1]
    other = make_sequence(2, [7] + prompt[1:])
    assert kv.cached_prefix(other).pages == ()  # the chain differs from the first page on


def test_freed_named_pages_park_and_are_evicted_least_recently_used_first():
    kv = KVManager(4, PAGE)
    a = computed(kv, 0, list(range(8)))
    b = computed(kv, 1, list(range(50, 58)))
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_cached == 4 and kv.num_free == 4
    revived = make_sequence(2, list(range(8)) + [9])
    prefix = kv.cached_prefix(revived)
    assert prefix.pages == tuple(kv.pool.lookup(d) for d in revived.page_hashes[:2]) and prefix.num_parked == 2
    fresh = make_sequence(3, [1])
    kv.grow(fresh, PAGE)  # no empty page left: the oldest parked page (a's first) goes
    assert kv.cached_prefix(make_sequence(4, list(range(8)) + [9])).pages == ()
    assert len(kv.cached_prefix(make_sequence(5, list(range(50, 58)) + [9])).pages) == 2


def test_trim_gives_back_pages_only_drafts_reached():
    kv = KVManager(8, PAGE, prefix_caching=False)
    a = make_sequence(0, list(range(7)))
    kv.grow(a, 7 + 4)  # room for four draft tokens
    assert len(a.pages) == 3
    kv.trim(a, 8)
    assert len(a.pages) == 2 and kv.num_free == 6


def test_sliding_window_releases_pages_no_query_can_see():
    kv = KVManager(16, PAGE, sliding_window=6)
    a = computed(kv, 0, list(range(20)))  # five pages; the next query is position 20
    kv.release_out_of_window(a)
    # position 20 sees keys 15..20: pages 0-2 (positions 0-11) are dead, page 3 (12-15) is not
    assert a.pages[:3] == [HOLE] * 3 and HOLE not in a.pages[3:]
    assert kv.pool.num_used == 2 and kv.pool.num_cached == 3  # named pages park for the prefix cache
    kv.free(a)
    assert kv.num_free == 16


def test_sliding_window_prefix_hit_needs_only_the_pages_in_the_window():
    prompt = list(range(200, 224))  # six pages
    for window, expect_hit in ((6, True), (None, False)):
        kv = KVManager(8, PAGE, sliding_window=window)
        a = computed(kv, 0, prompt)
        kv.free(a)
        # evict the two oldest parked pages (the chain's first pages)
        filler = make_sequence(1, [1])
        kv.grow(filler, 4 * PAGE)
        b = make_sequence(2, prompt + [5])
        prefix = kv.cached_prefix(b)
        if not expect_hit:
            assert prefix.pages == ()
            continue
        # b's next query is position 24 (all six pages cached, the last token in a seventh):
        # it sees keys 19..24, so pages 4 and 5 are needed and earlier ones may be holes
        assert prefix.pages[:4] == (HOLE,) * 4 and HOLE not in prefix.pages[4:]
        assert len(prefix.pages) == 6
        kv.take_prefix(b, prefix)
        assert b.num_computed == 24 and b.released_pages == 4
