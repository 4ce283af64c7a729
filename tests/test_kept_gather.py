"""Kept gathers (kernels/kept_gather.py): paged attention on a cache registered with
keep_gathered equals the stateless gather's (an unregistered copy of the same cache)
step after step, while rows decode, verify drafts and roll back, finish, share prefix
pages and have their freed pages reused by new rows, and when writes pile up unseen."""

from __future__ import annotations

import math
import random

import pytest
import torch

import kernels
from kernels import kept_gather

HQ, HKV, D, PAGE, PAGES = 6, 2, 8, 4, 64


class Rows:
    """Sequences over one layer's paged cache, written through kernels.write_kv."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.k_cache = torch.zeros(HKV, PAGES, PAGE, D)
        self.v_cache = torch.zeros(HKV, PAGES, PAGE, D)
        kernels.keep_gathered(self.k_cache, self.v_cache)
        self.free = list(range(PAGES))
        self.refs = [0] * PAGES
        self.rows: list[tuple[list[int], int]] = []  # (pages, context length)

    def write(self, pages: list[int], start: int, count: int) -> None:
        """New K/V for positions [start, start + count) of a row with these pages."""
        while len(pages) * PAGE < start + count:
            page = self.free.pop(0)
            self.refs[page] = 1
            pages.append(page)
        slots = torch.tensor([pages[p // PAGE] * PAGE + p % PAGE for p in range(start, start + count)])
        kernels.write_kv(torch.randn(count, HKV, D), torch.randn(count, HKV, D), self.k_cache, self.v_cache, slots)

    def release(self, pages: list[int]) -> None:
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free.append(page)

    def start(self) -> None:
        """A new row: sometimes sharing another row's full first page (prefix dedup), then a prompt."""
        pages: list[int] = []
        shared = 0
        donors = [p for p, ctx in self.rows if ctx > PAGE]
        if donors and self.rng.random() < 0.3:
            pages = [self.rng.choice(donors)[0]]
            self.refs[pages[0]] += 1
            shared = PAGE
        length = shared + self.rng.randint(1, 20)
        self.write(pages, shared, length - shared)
        self.rows.append((pages, length))

    def step(self) -> list[int]:
        """Each row decodes one token or verifies three drafts (keeping 1-4 of the 4 written);
        returns the query length of each row this step."""
        q_lens = []
        for i, (pages, ctx) in enumerate(self.rows):
            q_len = 4 if self.rng.random() < 0.25 else 1
            self.write(pages, ctx, q_len)
            q_lens.append(q_len)
            self.rows[i] = (pages, ctx + q_len)
        return q_lens

    def attend(self, q_lens: list[int]) -> None:
        """This step's attention on the registered cache against an unregistered copy's."""
        width = max(len(p) for p, _ in self.rows)
        table = torch.tensor([p + [0] * (width - len(p)) for p, _ in self.rows], dtype=torch.int32)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        ctx = torch.tensor([c for _, c in self.rows], dtype=torch.int32)
        q = torch.randn(sum(q_lens), HQ, D)
        args = (table, cu, ctx, 1 / math.sqrt(D))
        got = kernels.paged_attention(q, self.k_cache, self.v_cache, *args)
        want = kernels.paged_attention(q, self.k_cache.clone(), self.v_cache.clone(), *args)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)

    def settle(self, q_lens: list[int]) -> None:
        """Verify rows roll back their rejected drafts; some rows finish and free their pages."""
        for i, q_len in enumerate(q_lens):
            pages, ctx = self.rows[i]
            if q_len > 1:
                self.rows[i] = (pages, ctx - self.rng.randint(0, q_len - 1))
        for i in reversed(range(len(self.rows))):
            if self.rng.random() < 0.1 or len(self.free) < 8:
                self.release(self.rows.pop(i)[0])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("inference", [False, True])
def test_kept_gather_equals_a_fresh_gather_step_after_step(seed: int, inference: bool):
    torch.manual_seed(seed)
    rows = Rows(seed)
    with torch.inference_mode(inference):
        for _ in range(60):
            while len(rows.rows) < 6 and len(rows.free) > 12:
                rows.start()
            q_lens = rows.step()
            rows.attend(q_lens)
            rows.settle(q_lens)
    assert kept_gather.lookup(rows.k_cache, rows.v_cache) is not None


def test_attention_after_more_unseen_writes_than_kept_stays_right():
    torch.manual_seed(0)
    rows = Rows(0)
    for _ in range(4):
        rows.start()
    rows.attend(rows.step())
    for _ in range(kept_gather.MAX_PENDING_WRITES + 3):  # prefill-only steps: writes, no decode attention
        pages, ctx = rows.rows[0]
        rows.write(pages, ctx - 1, 1)
    rows.attend(rows.step())


def test_an_unregistered_cache_keeps_nothing():
    k_cache, v_cache = torch.zeros(HKV, PAGES, PAGE, D), torch.zeros(HKV, PAGES, PAGE, D)
    assert kept_gather.lookup(k_cache, v_cache) is None
    kernels.keep_gathered(k_cache, v_cache)
    assert kept_gather.lookup(k_cache, v_cache) is not None
    assert kept_gather.lookup(k_cache, v_cache.clone()) is None
