"""The CPU paged attention (kernels/reference.py) against dense attention written
out per sequence: decode and verify rows batched with a mask, a whole prompt
through SDPA's causal flag, a prompt's later chunk with a mask."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.reference import paged_attention

HQ, HKV, D, PAGE = 6, 2, 16, 4


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, window: int | None) -> torch.Tensor:
    """q [Lq, HQ, D] at the last Lq of ctx positions; k/v [ctx, HKV, D]."""
    q_len = q.shape[0]
    group = HQ // HKV
    out = torch.empty_like(q)
    for i in range(q_len):
        pos = ctx - q_len + i
        lo = 0 if window is None else max(0, pos - window + 1)
        for h in range(HQ):
            keys, values = k[lo:pos + 1, h // group], v[lo:pos + 1, h // group]
            weights = torch.softmax(keys @ q[i, h] / math.sqrt(D), dim=0)
            out[i, h] = weights @ values
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_rows_equal_dense_attention(window: int | None):
    torch.manual_seed(0)
    # (query tokens, context length): decode, verify (1 + 3 drafts), a whole prompt, a prompt's second chunk
    rows = [(1, 9), (1, 23), (4, 14), (20, 20), (18, 30), (1, 2)]
    pages_per_row = max(-(-ctx // PAGE) for _, ctx in rows)
    num_pages = 1 + len(rows) * pages_per_row
    k_cache = torch.randn(HKV, num_pages, PAGE, D)
    v_cache = torch.randn(HKV, num_pages, PAGE, D)
    order = torch.randperm(num_pages - 1) + 1
    table = order.view(len(rows), pages_per_row).to(torch.int32)
    q = torch.randn(sum(n for n, _ in rows), HQ, D)
    cu = torch.tensor([0, *torch.tensor([n for n, _ in rows]).cumsum(0).tolist()], dtype=torch.int32)
    ctx = torch.tensor([c for _, c in rows], dtype=torch.int32)

    got = paged_attention(q, k_cache, v_cache, table, cu, ctx, 1 / math.sqrt(D), window)

    for b, (_, length) in enumerate(rows):
        pages = table[b, : -(-length // PAGE)].long()
        k = k_cache[:, pages].reshape(HKV, -1, D)[:, :length].transpose(0, 1)
        v = v_cache[:, pages].reshape(HKV, -1, D)[:, :length].transpose(0, 1)
        want = dense(q[cu[b] : cu[b + 1]], k, v, length, window)
        torch.testing.assert_close(got[cu[b] : cu[b + 1]], want, rtol=1e-5, atol=1e-5)
