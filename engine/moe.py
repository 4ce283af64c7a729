"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE) with a batched expert dispatch.

Routing, as each family's reference computes it: softmax over the router
logits in fp32, the top-k experts per token, their weights renormalised to
sum to 1 (always for Mixtral, when norm_topk_prob for Qwen3-MoE); Mixtral
weighs expert outputs with those fp32 weights, Qwen3-MoE first casts them to
the activation dtype.

Dispatch: the T * k (token, expert) pairs are sorted by expert, so each
expert's tokens form one contiguous segment; every expert that received
tokens then runs once, as two matmuls over its whole segment, and the
weighted outputs are scattered back with one index_add_. The Python loop is
over experts (at most num_experts iterations, empty ones skipped), never over
tokens, and no expert weight is copied. Gathering each token's expert weights
instead would move k * 3 * H * I weights per token, far more than the
activations, at decode batch sizes.

On CUDA the dispatch reads nothing back (docs/gpu.md's sync budget): the
segment sizes stay on the device, and in bf16 one grouped GEMM per projection
(torch._grouped_mm, offsets on the device) runs every expert's segment at
once; its kernels take bf16 only, so other dtypes on CUDA run every expert
over every token with the unselected experts weighted 0 (num_experts / top_k
times the useful FLOPs, the same sums). On the CPU, where reading the segment
sizes costs nothing, the loop over experts is the reference.

The experts' weights are stacked as [E, 2 * I, H] (gate then up, as the
dense MLP fuses them) and [E, H, I], the layout transformers 5 uses in memory.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.layers import act_and_mul


class Experts(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        num, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num, hidden, inter))
        self.hidden_act = config.hidden_act

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, H] sorted by expert, counts[e] rows each ([E] on x's device) -> each row through its expert."""
        return self.grouped(x, counts) if x.is_cuda else self.looped(x, counts)

    def grouped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """One grouped GEMM per projection, segment offsets on the device (bf16)."""
        offsets = counts.cumsum(0).to(torch.int32)
        hidden = act_and_mul(torch._grouped_mm(x, self.gate_up_proj.transpose(1, 2), offs=offsets), self.hidden_act)
        return torch._grouped_mm(hidden, self.down_proj.transpose(1, 2), offs=offsets)

    def looped(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Two matmuls per expert that received rows, segment sizes read on the host."""
        out = torch.empty_like(x)
        start = 0
        for expert, count in enumerate(counts.tolist()):
            if count:
                rows = slice(start, start + count)
                hidden = act_and_mul(x[rows] @ self.gate_up_proj[expert].t(), self.hidden_act)
                out[rows] = hidden @ self.down_proj[expert].t()
                start += count
        return out


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.router_weights_fp32 = config.router_weights_fp32
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = Experts(config)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) per token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.router_weights_fp32:
            weights = weights.to(x.dtype)
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if x.is_cuda and x.dtype != torch.bfloat16:
            return self.every_expert(x, weights, experts)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, ascending
        token = order // self.top_k
        # the segment sizes, on the device (bincount's output size would be read from the data)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=x.device).index_add_(
            0, flat, torch.ones_like(flat))
        expert_out = self.experts(x[token], counts)
        weighted = (expert_out * weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
        # each token's contributions are summed in ascending expert order, as transformers does
        return torch.zeros_like(x).index_add_(0, token, weighted)

    def every_expert(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """The layer without a dispatch: every expert over every token, each token's unselected
        experts weighted 0, summed in ascending expert order as the dispatch sums."""
        mixing = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device).scatter_(
            1, experts, weights)
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            hidden = act_and_mul(x @ self.experts.gate_up_proj[expert].t(), self.experts.hidden_act)
            out += ((hidden @ self.experts.down_proj[expert].t()) * mixing[:, expert, None]).to(x.dtype)
        return out
