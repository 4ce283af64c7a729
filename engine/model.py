"""Decoder-only transformer (Llama / Mistral / Qwen2 / Qwen3) over a flattened
variable-length batch with a paged KV cache.

q/k/v and gate/up projections are fused into one matmul each; attention,
norms, RoPE and the activation go through kernels/.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.batch import ForwardBatch
from engine.config import ModelConfig
from engine.rope import inverse_frequencies, rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.sliding_window = config.sliding_window
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)[0]
            k = self.k_norm(k)[0]
        else:
            q, k = q.contiguous(), k.contiguous()
        kernels.apply_rope(q, k, cos, sin)
        kernels.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        out = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.cu_seqlens_q,
            batch.context_lens,
            self.scale,
            self.sliding_window,
        )
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            normed, _ = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(normed, cos, sin, k_cache, v_cache, batch)
        normed, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(normed), residual


class CausalLM(nn.Module):
    """The model: forward(batch, k_caches, v_caches) -> fp32 logits [N, vocab]
    for the rows named by batch.logits_indices."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", inverse_frequencies(config.rope, config.head_dim), persistent=False)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_caches: torch.Tensor, v_caches: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        if batch.embeddings is not None:
            rows, vectors = batch.embeddings
            hidden[rows] = vectors.to(hidden.dtype)
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq)
        residual: torch.Tensor | None = None
        for layer, k_cache, v_cache in zip(self.layers, k_caches, v_caches):
            hidden, residual = layer(hidden, residual, cos, sin, k_cache, v_cache, batch)
        rows = batch.logits_indices
        hidden, _ = self.norm(hidden[rows], residual[rows] if residual is not None else None)
        return self.lm_head(hidden).float()
