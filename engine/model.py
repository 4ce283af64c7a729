"""Decoder-only transformer over a flattened variable-length batch with a
paged KV cache: Llama, Mistral, Qwen2/3, Gemma 2/3, Phi-3, Mixtral, Qwen3-MoE.

This module assembles the layers (engine/layers.py, engine/moe.py) and the
rotary embeddings (engine/rope.py) into the model; each layer takes its own
attention window, RoPE table and MLP kind from ModelConfig.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.batch import ForwardBatch
from engine.cache import KVCache
from engine.config import ModelConfig
from engine.layers import MLP, Attention, RMSNorm
from engine.moe import SparseMoE
from engine.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        eps, offset = config.rms_norm_eps, config.norm_unit_offset
        self.input_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, offset)
        self.mlp: nn.Module = SparseMoE(config) if config.layer_is_moe(layer) else MLP(config, layer)
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps, offset)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output, the residual stream before it): the next norm adds them."""
        if residual is None:
            residual = hidden
            normed, _ = self.input_layernorm(hidden)
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(normed, cos, sin, batch)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            normed, residual = self.post_attention_layernorm(hidden, residual)
            return self._mlp(normed, batch), residual
        # Gemma: the attention and MLP outputs are normed before they join the residual
        hidden, _ = self.post_attention_layernorm(hidden)
        normed, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden, _ = self.post_feedforward_layernorm(self._mlp(normed, batch))
        return hidden, residual

    def _mlp(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The MLP, with the step's LoRA deltas when some row runs an adapter (never on MoE layers:
        adapters that target them are refused at load)."""
        if batch.lora is None or not isinstance(self.mlp, MLP):
            return self.mlp(x)
        return self.mlp(x, batch.lora)


class CausalLM(nn.Module):
    """The model: forward(batch) -> fp32 logits [N, vocab] for the rows named by
    batch.logits_indices, over the KV cache bound with bind_cache()."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)
        self.sliding_rotary = None
        if config.sliding_rope is not None:
            self.sliding_rotary = RotaryEmbedding(config.sliding_rope, config.head_dim)
        # per layer: whether it takes the sliding layers' RoPE table
        self.layer_uses_sliding_rope = [
            self.sliding_rotary is not None and config.layer_window(i) is not None for i in range(config.num_layers)
        ]
        self.bound_cache: KVCache | None = None

    def bind_cache(self, cache: KVCache) -> None:
        """Give each layer its slices of the cache's K/V tensors, once per cache
        (not per forward: static addresses, as CUDA-graph capture needs)."""
        if cache.k.shape[0] != len(self.layers):
            raise ValueError(f"the cache has {cache.k.shape[0]} layers, the model {len(self.layers)}")
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, DecoderLayer)
            attention = layer.self_attn
            attention.k_cache, attention.v_cache = cache.k[i], cache.v[i]
            attention.k_scales = cache.k_scales[i] if cache.k_scales is not None else None
            attention.v_scales = cache.v_scales[i] if cache.v_scales is not None else None
        self.bound_cache = cache

    def reset_buffers(self, device: torch.device | str) -> None:
        """Compute the RoPE frequency buffers (not in checkpoints) on `device`,
        e.g. after building the model on the meta device."""
        for rotary in (self.rotary, self.sliding_rotary):
            if rotary is not None:
                rotary.reset_buffers(device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        if self.config.embed_scale != 1.0:
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        if batch.embeddings is not None:
            rows, vectors = batch.embeddings
            hidden[rows] = vectors.to(hidden.dtype)
        tables = [self.rotary(batch.positions)]
        if self.sliding_rotary is not None:
            tables.append(self.sliding_rotary(batch.positions))
        residual: torch.Tensor | None = None
        for layer, sliding_rope in zip(self.layers, self.layer_uses_sliding_rope, strict=True):
            cos, sin = tables[1 if sliding_rope else 0]
            hidden, residual = layer(hidden, residual, cos, sin, batch)
        rows = batch.logits_indices
        hidden, _ = self.norm(hidden[rows], residual[rows] if residual is not None else None)
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
