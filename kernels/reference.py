"""Torch reference implementations of every kernel, with the signatures the
Triton kernels implement. They keep the paged KV layout, run on any device,
and are the CPU path of the engine.

Paged layout: each layer's K (and V) cache is a tensor
[num_pages, page_size, num_kv_heads, head_dim]; token slot s lives at
page s // page_size, offset s % page_size. A sequence's page table lists its
physical pages in logical order (rows padded with any valid page index).

Variable-length batch: the T query tokens of B sequences are concatenated;
cu_seqlens_q [B+1] delimits them, and context_lens [B] is each sequence's
length including this step's tokens, so query i of sequence b sits at
position context_lens[b] - q_len[b] + i and attends causally to positions
<= that (and > position - sliding_window when a window is set).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm in fp32, as Hugging Face computes it; with `residual`, first
    adds it to x and also returns the sum (the next residual)."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), residual


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (rotate-half layout).
    cos/sin are [T, D] (the half-frequency table repeated twice)."""
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    for x in (q, k):
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        x.copy_(x * cos + rotated * sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for the fused [T, 2 * I] gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store this step's K/V [T, Hkv, D] into their cache slots."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over each sequence's paged context -> [T, Hq, D].

    Single-token (decode) rows are gathered into one padded batch; multi-token
    (prefill chunk) rows run one sequence at a time with a causal offset mask.
    """
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(ctx))]
    decode_rows = [b for b, n in enumerate(q_lens) if n == 1]
    if decode_rows:
        rows = torch.tensor(decode_rows, device=q.device)
        token_idx = cu_seqlens_q[:-1].long()[rows]
        out[token_idx] = _attend(
            q[token_idx].unsqueeze(1), k_cache, v_cache, page_table[rows], context_lens[rows], scale, sliding_window
        ).squeeze(1)
    for b, n in enumerate(q_lens):
        if n > 1:
            s = starts[b]
            out[s : s + n] = _attend(
                q[s : s + n].unsqueeze(0),
                k_cache,
                v_cache,
                page_table[b : b + 1],
                context_lens[b : b + 1],
                scale,
                sliding_window,
            ).squeeze(0)
    return out


def _attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """q [B, Lq, Hq, D] (the last Lq positions of each context) -> [B, Lq, Hq, D]."""
    batch, q_len = q.shape[0], q.shape[1]
    page_size, num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    max_ctx = int(context_lens.max())
    key_pos = torch.arange(max_ctx, device=q.device)
    slots = page_table[:, key_pos // page_size].long() * page_size + key_pos % page_size
    keys = k_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(1, 2)
    values = v_cache.view(-1, num_kv_heads, head_dim)[slots].transpose(1, 2)
    ctx = context_lens.long().view(batch, 1, 1)
    query_pos = ctx - q_len + torch.arange(q_len, device=q.device).view(1, q_len, 1)
    mask = key_pos.view(1, 1, max_ctx) <= query_pos
    if sliding_window is not None:
        mask &= key_pos.view(1, 1, max_ctx) > query_pos - sliding_window
    attn = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=mask.unsqueeze(1), scale=scale,
        enable_gqa=True,
    )
    return attn.transpose(1, 2)
