"""Torch reference implementations of every kernel, with the signatures the
Triton kernels implement. They keep the paged KV layout, run on any device,
and are the CPU path of the engine: what the genq:: operators
(kernels/ops.py) run on CPU tensors.

Paged layout: each layer's K (and V) cache is a tensor
[num_kv_heads, num_pages, page_size, head_dim]; token slot s lives at
page s // page_size, offset s % page_size. Heads outermost keeps every
(head, page) block contiguous, so gathering a sequence's pages yields each
head's keys as one contiguous [tokens, head_dim] run. A sequence's page
table lists its physical pages in logical order (rows padded with any valid
page index).

Variable-length batch: the T query tokens of B sequences are concatenated;
cu_seqlens_q [B+1] delimits them, and context_lens [B] is each sequence's
length including this step's tokens, so query i of sequence b sits at
position context_lens[b] - q_len[b] + i and attends causally to positions
<= that (and > position - sliding_window when a window is set).

Bidirectional spans (Gemma 3's images): `bidirectional[b]` lists [start, end)
position runs of sequence b whose positions also attend to each other ahead
of themselves (transformers' token_type_ids mask: causal OR same span, then
the sliding window). The whole span must be in the context (the scheduler
never splits one); None (every text-only step) costs nothing.

Soft-capping (Gemma 2): with a cap c, scaled scores s become c * tanh(s / c)
before the mask and the softmax.

Quantized caches (kernels/kv_quant.py; each cache's dtype picks its format, K's
and V's separately):
write_kv quantizes each (head, token) vector into its slot and its scales;
paged_attention dequantizes only the pages it gathers, into a per-call
workspace, and never the whole cache.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.kv_quant import KVFormat, dequantize_into, paged_formats, quantize, rotate


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    unit_offset: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm in fp32, as Hugging Face computes it; with `residual`, first
    adds it to x and also returns the sum (the next residual).

    Llama's convention: weight * normed.to(x.dtype). unit_offset is Gemma's:
    (normed * (1 + weight)) in fp32, then cast to x's dtype."""
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (x32 * (1.0 + weight.float())).to(x.dtype), residual
    return weight * x32.to(x.dtype), residual


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] in place (rotate-half layout).
    cos/sin are [T, R] (the half-frequency table repeated twice; any scaling,
    llama3 included, is already in the table); R < D is partial rotary: only
    the first R dims of each head rotate."""
    cos = cos.unsqueeze(1).to(q.dtype)
    sin = sin.unsqueeze(1).to(q.dtype)
    rotary = cos.shape[-1]
    half = rotary // 2
    for x in (q, k):
        part = x[..., :rotary]
        rotated = torch.cat((-part[..., half:], part[..., :half]), dim=-1)
        part.copy_(part * cos + rotated * sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for the fused [T, 2 * I] gate/up projection."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GELU(gate, tanh approximation) * up for the fused [T, 2 * I] gate/up projection (Gemma)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Store this step's K/V [T, Hkv, D] into their cache slots; a quantized
    cache (fp8 / q8 / q4, by its dtype; K and V may differ, as in k8v4) also
    gets each vector's scales in k_scales / v_scales [Hkv, pages, page_size,
    groups], which it requires."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    formats = paged_formats(k_cache, v_cache, k_scales, v_scales, head_dim)
    for new, cache, scales, fmt in zip((k, v), (k_cache, v_cache), (k_scales, v_scales), formats):
        if scales is None or not fmt.quantized:
            cache.view(num_kv_heads, -1, head_dim).index_copy_(1, slot_mapping, new.transpose(0, 1).to(cache.dtype))
            continue
        data, new_scales = quantize(new.transpose(0, 1), fmt)
        _bits(cache).view(num_kv_heads, -1, fmt.data_dim).index_copy_(1, slot_mapping, _bits(data))
        scales.view(num_kv_heads, -1, fmt.scale_groups).index_copy_(1, slot_mapping, new_scales)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """fp8 tensors as their uint8 bit patterns (torch's CPU index_copy_ has no fp8)."""
    return x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    bidirectional: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> torch.Tensor:
    """Attention of q [T, Hq, D] over each sequence's paged context -> [T, Hq, D].
    A quantized cache needs its scales (see write_kv); a rotated K format's
    (fp8) rotation is applied to q, a rotated V format's undone on the
    output, here.

    Rows with few query tokens (decodes, and speculative verify rows of
    1 + drafts) are grouped by query length and context length, so padding
    to the longest row in a group wastes at most ~30%, and each group runs as
    one padded batch; longer (prefill chunk) rows run one sequence at a time.
    """
    k_fmt, v_fmt = paged_formats(k_cache, v_cache, k_scales, v_scales, q.shape[-1])
    q = rotate(q, k_fmt)
    kv = _PagedKV(k_cache, v_cache, k_scales, v_scales, k_fmt, v_fmt)
    out = torch.empty_like(q)
    starts = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    page_size = k_cache.shape[2]
    short_rows: dict[int, list[int]] = {}
    for b in range(len(ctx)):
        q_len = starts[b + 1] - starts[b]
        if q_len <= BATCHED_QUERY_LEN:
            short_rows.setdefault(q_len, []).append(b)
            continue
        s = starts[b]
        out[s : s + q_len] = _attend(
            q[s : s + q_len].unsqueeze(0), kv, page_table[b : b + 1], ctx[b : b + 1], scale, sliding_window,
            softcap, None if bidirectional is None else [bidirectional[b]],
        ).squeeze(0)
    for q_len, rows in short_rows.items():
        for group in _length_groups(rows, ctx, page_size):
            index = torch.tensor(group, device=q.device)
            starts = cu_seqlens_q[:-1].long()[index].unsqueeze(1)
            token_idx = (starts + torch.arange(q_len, device=q.device)).reshape(-1)
            out[token_idx] = _attend(
                q[token_idx].view(len(group), q_len, *q.shape[1:]), kv, page_table[index], [ctx[b] for b in group],
                scale, sliding_window, softcap, None if bidirectional is None else [bidirectional[b] for b in group],
            ).reshape(-1, *q.shape[1:])
    return rotate(out, v_fmt)


def _length_groups(rows: list[int], ctx: list[int], page_size: int, min_fill: float = 0.7) -> list[list[int]]:
    """Split rows, longest context first, so each row needs at least min_fill
    of its group's longest page count."""
    groups: list[list[int]] = []
    group_pages = 0
    for b in sorted(rows, key=lambda r: -ctx[r]):
        pages = -(-ctx[b] // page_size)
        if not groups or pages < min_fill * group_pages:
            groups.append([])
            group_pages = pages
        groups[-1].append(b)
    return groups


#: Rows with at most this many query tokens are batched together (decode, verify).
BATCHED_QUERY_LEN = 16

_workspace = threading.local()


def _gather_buffer(slot: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer for gathered pages. Allocating tens of MB per layer
    would page-fault fresh memory on every call, which costs more on CPU than
    the copy itself. A buffer made under torch.inference_mode (the engine's
    forward) cannot be written in place outside it, so each mode has its own."""
    key = (slot, dtype, device, torch.is_inference_mode_enabled())
    buffers = getattr(_workspace, "buffers", None)
    if buffers is None:
        buffers = _workspace.buffers = {}
    numel = math.prod(shape)
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel].view(shape)


class _PagedKV(NamedTuple):
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scales: torch.Tensor | None
    v_scales: torch.Tensor | None
    k_fmt: KVFormat
    v_fmt: KVFormat

    def gather(self, which: int, pages: torch.Tensor, head_dim: int) -> torch.Tensor:
        """The listed pages of K (which=0) or V (1), [Hkv, len(pages), page_size, head_dim],
        in the cache's dtype, or dequantized to fp32 (fp8: still rotated) for a quantized cache."""
        cache = (self.k_cache, self.v_cache)[which]
        num_kv_heads, page_size = cache.shape[0], cache.shape[2]
        shape = (num_kv_heads, pages.numel(), page_size, cache.shape[3])
        data = torch.index_select(cache, 1, pages, out=_gather_buffer(which, shape, cache.dtype, cache.device))
        scales = (self.k_scales, self.v_scales)[which]
        fmt = (self.k_fmt, self.v_fmt)[which]
        if scales is None or not fmt.quantized:
            return data
        values = _gather_buffer(2 + which, (*shape[:-1], head_dim), torch.float32, cache.device)
        return dequantize_into(values, data, torch.index_select(scales, 1, pages), fmt)


def _attend(
    q: torch.Tensor,
    kv: _PagedKV,
    page_table: torch.Tensor,
    context_lens: list[int],
    scale: float,
    sliding_window: int | None,
    softcap: float | None = None,
    bidirectional: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> torch.Tensor:
    """q [B, Lq, Hq, D] (the last Lq positions of each context) -> [B, Lq, Hq, D]."""
    batch, q_len, head_dim = q.shape[0], q.shape[1], q.shape[3]
    num_kv_heads, page_size = kv.k_cache.shape[0], kv.k_cache.shape[2]
    num_pages = -(-max(context_lens) // page_size)
    pages = page_table[:, :num_pages].reshape(-1).long()
    keys = kv.gather(0, pages, head_dim)
    values = kv.gather(1, pages, head_dim)
    span = num_pages * page_size
    keys = keys.view(num_kv_heads, batch, span, head_dim).permute(1, 0, 2, 3)
    values = values.view(num_kv_heads, batch, span, head_dim).permute(1, 0, 2, 3)
    key_pos = torch.arange(span, device=q.device).view(1, 1, span)
    ctx = torch.tensor(context_lens, device=q.device).view(batch, 1, 1)
    query_pos = ctx - q_len + torch.arange(q_len, device=q.device).view(1, q_len, 1)
    mask = key_pos <= query_pos
    if bidirectional is not None and any(bidirectional):
        mask = mask | _same_span(bidirectional, query_pos.view(batch, q_len), span)
    if sliding_window is not None:
        mask &= key_pos > query_pos - sliding_window
    if softcap is not None:
        return _softcapped(q, keys.to(q.dtype), values.to(q.dtype), mask, scale, softcap)
    # A whole prompt from position 0 (no window, no image spans) is SDPA's own causal case:
    # is_causal skips the boolean mask, ~20% of a 512-token prompt's attention time on CPU.
    causal = batch == 1 and context_lens[0] == q_len and sliding_window is None and not bidirectional
    attn = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype), attn_mask=None if causal else mask.unsqueeze(1),
        scale=scale, is_causal=causal, enable_gqa=True,
    )
    return attn.transpose(1, 2)


def _same_span(spans: Sequence[Sequence[tuple[int, int]]], query_pos: torch.Tensor, span: int) -> torch.Tensor:
    """[B, Lq, span]: query and key positions inside one bidirectional span of their sequence."""
    ids = torch.full((len(spans), span), -1, dtype=torch.long)
    for b, runs in enumerate(spans):
        for index, (start, end) in enumerate(runs):
            ids[b, start:end] = index
    ids = ids.to(query_pos.device)
    query_ids = ids.gather(1, query_pos).unsqueeze(-1)
    return (query_ids == ids.unsqueeze(1)) & (query_ids >= 0)


def _softcapped(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with tanh soft-capped scores (SDPA has no soft-cap), as
    Gemma 2 computes it: q [B, Lq, Hq, D], keys/values [B, Hkv, S, D], mask [B, Lq, S]."""
    batch, q_len, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    group = num_heads // num_kv_heads
    # [B, Hkv, G * Lq, D]: each KV head's G query heads side by side, no K/V copies
    grouped = q.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    grouped = grouped.reshape(batch, num_kv_heads, group * q_len, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    visible = mask.unsqueeze(1).unsqueeze(2).expand(batch, 1, group, q_len, mask.shape[-1])
    scores = scores.masked_fill(~visible.reshape(batch, 1, group * q_len, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, values).view(batch, num_kv_heads, group, q_len, head_dim)
    return out.permute(0, 3, 1, 2, 4).reshape(batch, q_len, num_heads, head_dim)
