"""The decoder linears a LoRA adapter may target, as PEFT names them, and where each sits in the
engine's fused projections (q/k/v share qkv_proj, gate/up share gate_up_proj: engine/layers.py)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import ModelConfig

#: PEFT's module name -> (the engine's fused linear, which of its output slices)
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
#: The MLP's targets: absent from a mixture-of-experts layer.
MLP_TARGETS = frozenset({"gate_proj", "up_proj", "down_proj"})


@dataclass(frozen=True)
class FusedShape:
    """A fused linear's input width and the output width of each of its slices, in order."""

    in_features: int
    slices: tuple[int, ...]

    @property
    def out_features(self) -> int:
        return sum(self.slices)

    def offset(self, index: int) -> int:
        return sum(self.slices[:index])


def fused_shapes(config: ModelConfig) -> dict[str, FusedShape]:
    """Each fused linear's shape for this model."""
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv_proj": FusedShape(hidden, (q_size, kv_size, kv_size)),
        "o_proj": FusedShape(q_size, (hidden,)),
        "gate_up_proj": FusedShape(hidden, (inter, inter)),
        "down_proj": FusedShape(inter, (hidden,)),
    }
