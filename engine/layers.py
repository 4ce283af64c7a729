"""The building blocks of a decoder layer: RMSNorm, attention over the paged
KV cache, and the gated MLP.

q/k/v and gate/up projections are fused into one matmul each (Phi-3's
checkpoints already store them so); attention, norms, RoPE and the
activation go through kernels/. What differs between families (Gemma's
(1 + weight) norms and soft-capped attention, per-layer sliding windows,
q/k norms, the activation) is read from ModelConfig here, once.
"""

from __future__ import annotations

import torch
from torch import nn

import kernels
from engine.batch import ForwardBatch
from engine.config import ModelConfig
from engine.lora.batch import LoraBatch


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        # Gemma stores weight - 1 (its norm scales by 1 + weight), so its neutral weight is 0
        self.weight = nn.Parameter(torch.zeros(size) if unit_offset else torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return kernels.rms_norm(x, self.weight, self.eps, residual, self.unit_offset)


def act_and_mul(gate_up: torch.Tensor, hidden_act: str) -> torch.Tensor:
    """act(gate) * up over a fused [T, 2 * I] gate/up projection (the kernel is
    looked up per call, so wrapping kernels' functions, as the profiler does, sees it)."""
    if hidden_act == "gelu_pytorch_tanh":
        return kernels.gelu_tanh_and_mul(gate_up)
    return kernels.silu_and_mul(gate_up)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attn_scale if config.attn_scale is not None else config.head_dim**-0.5
        self.sliding_window = config.layer_window(layer)
        self.softcap = config.attn_logit_softcap
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_unit_offset)
        # This layer's pages of the KV cache, bound once (CausalLM.bind_cache), not passed per call:
        # plain attributes, so they are neither parameters nor saved with the weights.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # A quantized cache's float16 scales per token and head (None for a full-precision cache).
        self.k_scales: torch.Tensor | None = None
        self.v_scales: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is None or v_cache is None:
            raise RuntimeError("no KV cache bound to the model: call CausalLM.bind_cache(cache) first")
        qkv = self.qkv_proj(x)
        if batch.lora is not None:
            qkv = batch.lora.add(qkv, x, self.layer, "qkv_proj")
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q)[0]
            k = self.k_norm(k)[0]
        else:
            q, k = q.contiguous(), k.contiguous()
        kernels.apply_rope(q, k, cos, sin)
        kernels.write_kv(k, v, k_cache, v_cache, batch.slot_mapping, self.k_scales, self.v_scales)
        out = kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            batch.page_table,
            batch.cu_seqlens_q,
            batch.context_lens,
            self.scale,
            self.sliding_window,
            self.softcap,
            self.k_scales,
            self.v_scales,
            batch.bidirectional,
        )
        out = out.reshape(-1, self.q_size)
        if batch.lora is None:
            return self.o_proj(out)
        return batch.lora.add(self.o_proj(out), out, self.layer, "o_proj")


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.hidden_act = config.hidden_act

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """lora: the step's adapters, whose deltas the gate/up and down projections add."""
        if lora is None:
            return self.down_proj(act_and_mul(self.gate_up_proj(x), self.hidden_act))
        hidden = act_and_mul(lora.add(self.gate_up_proj(x), x, self.layer, "gate_up_proj"), self.hidden_act)
        return lora.add(self.down_proj(hidden), hidden, self.layer, "down_proj")
