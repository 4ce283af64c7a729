"""Read a llama.cpp GGUF file in the engine's own terms.

A GGUF file holds what an HF directory spreads over config.json, the
safetensors shards and tokenizer.json, under llama.cpp's names. Rather than
teach the model code a second vocabulary, this module translates: metadata
becomes an HF-style config dict (fed to ModelConfig.from_dict, so every check
and every family rule applies unchanged) and each tensor comes out under its
HF name, dequantized and with llama.cpp's Q/K row interleaving undone, ready
for the same weight assignment safetensors checkpoints go through.

With a `quantize` format the linear layers' weights come out as
QuantizedWeight instead (engine/quantized_linear.py), always with groups of
GGUF_GROUP_SIZE = 32 columns: built from the blocks where the file's type
maps exactly (Q4_0 / Q4_1 / Q4_K onto int4, Q8_0 onto int8;
engine/gguf_dequant.to_quantized), otherwise dequantized to fp32 one tensor
at a time and quantized again: e.g. "int4" on a Q8_0, Q5_K or F16 file, or
"int8" on a 4-bit file (twice int4's memory, and not exact: prefer int4).

Q8_0 keeps its group-32 scales rather than being requantized per output
channel (which the faster CPU int8 kernels need): measured on SmolLM2-135M
written as Q8_0, per-channel requantization adds 0.8% RMS weight error and
changes the logits (max |difference| 2.1, KL 0.006 to the file's own
weights, 1.4% of the positions' argmax tokens), while group 32 is exact
(logits identical to the dequantized model's). One group size for the whole
file, since llama.cpp mixes block types within a model and q/k/v share one
fused layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor

from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.gguf_dequant import SUPPORTED_TYPES, dequantize, to_quantized
from engine.quantized_linear import QuantizedWeight, quantize_weight

GGUF_GROUP_SIZE = 32  # the quantized layers' group size for GGUF files: its 32-value blocks map onto it

GGUF_MAGIC = b"GGUF"
REQUIRED = object()  # GGUFFile.value's default: the key must be present

# general.architecture -> the HF architecture whose config and weights it carries.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# llama.cpp's converter interleaves the two rotary halves of each Q/K head for
# these (its llama kernels rotate adjacent pairs); Qwen files keep HF's layout.
_PERMUTED_QK = frozenset({"llama", "mistral"})

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# blk.N.<gguf> -> model.layers.N.<hf>
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The layer tensors that are the weights of the engine's quantizable projections.
_LINEAR_TENSORS = frozenset({"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"})


def is_gguf(path: str | Path) -> bool:
    """Whether path names a single GGUF file (by suffix, or by its magic bytes)."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUFFile for path, shared while the file is unchanged: one load reads
    the tokenizer and the weights from the same file, and parsing the metadata
    of a large vocabulary takes seconds."""
    path = Path(path)
    if not path.is_file():
        return GGUFFile(path)
    stat = path.stat()
    return _open_unchanged(path.resolve(), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=1)
def _open_unchanged(path: Path, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


class GGUFFile:
    """One opened GGUF file: metadata lookups, the HF config, the HF-named tensors."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelLoadError(f"{self.path} does not exist")
        with self.path.open("rb") as f:
            magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path} is not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
        try:
            self.reader = GGUFReader(self.path)
        except ValueError as exc:
            if "GGMLQuantizationType" in str(exc):
                raise ModelLoadError(f"{self.path} holds a tensor of an unknown ggml quantization type: {exc}") from exc
            raise ModelLoadError(f"{self.path} is truncated or corrupt: {exc}") from exc
        except (IndexError, OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"{self.path} is truncated or corrupt: {exc}") from exc
        self.architecture = str(self.value("general.architecture"))

    def value(self, key: str, default: Any = REQUIRED) -> Any:
        """A metadata value (arrays come back as lists); without a default the key is required."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is REQUIRED:
                raise ModelLoadError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def _arch(self, key: str, default: Any = REQUIRED) -> Any:
        return self.value(f"{self.architecture}.{key}", default)

    def config_dict(self) -> dict[str, Any]:
        """config.json as transformers would write it for this model."""
        if self.architecture not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(ARCHITECTURES)}"
            )
        names = {t.name for t in self.reader.tensors}
        if "rope_freqs.weight" in names:
            raise UnsupportedArchitectureError(
                f"{self.path}: per-dimension RoPE frequency factors (rope_freqs.weight, Llama 3.1-style "
                "rope scaling) are not supported in GGUF files yet"
            )
        hidden = int(self._arch("embedding_length"))
        heads = int(self._arch("attention.head_count"))
        head_dim = int(self._arch("attention.key_length", hidden // heads))
        rotary = int(self._arch("rope.dimension_count", head_dim))
        if rotary != head_dim:
            raise UnsupportedArchitectureError(
                f"{self.path}: {self.architecture}.rope.dimension_count={rotary} rotates part of each "
                f"{head_dim}-dim head; only full rotary embeddings are supported"
            )
        vocab = self._arch("vocab_size", None)
        if vocab is None:
            vocab = len(self.value("tokenizer.ggml.tokens"))
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._arch("feed_forward_length")),
            "num_hidden_layers": int(self._arch("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self._arch("attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(self._arch("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(self._arch("context_length")),
            "rope_theta": float(self._arch("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "attention_bias": "blk.0.attn_q.bias" in names,
            "hidden_act": "silu",
            "torch_dtype": "float32",
        }
        scaling = self._rope_scaling()
        if scaling is not None:
            config["rope_scaling"] = scaling
        return config

    def _rope_scaling(self) -> dict[str, Any] | None:
        """llama.cpp's rope.scaling.* keys in transformers' rope_scaling spelling."""
        kind = self._arch("rope.scaling.type", "none")
        if kind == "none":
            return None
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(self._arch("rope.scaling.factor", 1.0))}
        original = self._arch("rope.scaling.original_context_length", None)
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

    @property
    def tensor_count(self) -> int:
        return len(self.reader.tensors)

    def hf_tensors(
        self,
        dtype: torch.dtype,
        config: dict[str, Any],
        progress: Callable[[int, int], None] | None = None,
        quantize: str | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(HF name, tensor in dtype) for every tensor, one at a time: peak memory
        is the model plus the one tensor being expanded. With quantize ("int8" or
        "int4"), the linear layers' weights come as QuantizedWeight."""
        total = self.tensor_count
        for number, tensor in enumerate(self.reader.tensors, start=1):
            hf_name = self._hf_name(tensor.name)
            values: torch.Tensor | QuantizedWeight
            if quantize is not None and self._is_linear_weight(tensor):
                values = self._quantized(tensor, quantize)
            else:
                values = self._dequantize(tensor).to(dtype)
            heads = None
            if self.architecture in _PERMUTED_QK and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
                heads = config["num_attention_heads"]
            elif self.architecture in _PERMUTED_QK and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
                heads = config["num_key_value_heads"]
            if heads is not None:
                # rows only move, and each row keeps its own blocks' scales: exact for quantized weights too
                values = _deinterleave(values, heads)
            yield hf_name, values
            if progress is not None:
                progress(number, total)

    def float_tensors(self) -> Iterator[tuple[str, Callable[[], torch.Tensor]]]:
        """(GGUF name, a reader of its float32 values) for every tensor in file order, read only when
        called: for files that are not a text model (an mmproj's vision tower)."""
        for tensor in self.reader.tensors:
            yield tensor.name, partial(self._dequantize, tensor)

    @staticmethod
    def _is_linear_weight(tensor: ReaderTensor) -> bool:
        parts = tensor.name.split(".")
        return len(parts) == 4 and parts[2] in _LINEAR_TENSORS and parts[3] == "weight"

    def _quantized(self, tensor: ReaderTensor, quantize: str) -> QuantizedWeight:
        kind = GGMLQuantizationType(tensor.tensor_type)
        rows, cols = (int(d) for d in reversed(tensor.shape.tolist()))
        exact = to_quantized(np.asarray(tensor.data), kind, (rows, cols), quantize)
        if exact is not None:
            return exact
        try:
            return quantize_weight(self._dequantize(tensor), quantize, GGUF_GROUP_SIZE)
        except ValueError as exc:
            raise ModelLoadError(
                f"{self.path}: tensor {tensor.name!r} cannot be quantized to {quantize}: {exc}"
            ) from exc

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_TENSORS:
            return _GLOBAL_TENSORS[name]
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
            return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
        raise ModelLoadError(f"{self.path}: unexpected tensor {name!r} for a {self.architecture} model")

    def _dequantize(self, tensor: ReaderTensor) -> torch.Tensor:
        kind = GGMLQuantizationType(tensor.tensor_type)
        if kind not in SUPPORTED_TYPES:
            supported = ", ".join(t.name for t in SUPPORTED_TYPES)
            raise ModelLoadError(
                f"{self.path}: tensor {tensor.name!r} is stored as {kind.name}, which is not supported "
                f"(supported: {supported})"
            )
        # GGUF lists dimensions innermost first; torch wants them outermost first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return dequantize(np.asarray(tensor.data), kind, shape, torch.float32)


def _deinterleave(values: torch.Tensor | QuantizedWeight, heads: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(values, QuantizedWeight):
        return values.map_rows(lambda rows: _deinterleave_rotary(rows, heads))
    return _deinterleave_rotary(values, heads)


def _deinterleave_rotary(values: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order: within each head it stores rotary pairs
    side by side (x0, x_half, x1, x_half+1, ...); HF keeps the two halves apart."""
    rows = values.shape[0]
    pairs = rows // heads // 2
    return values.reshape(heads, pairs, 2, *values.shape[1:]).transpose(1, 2).reshape(values.shape)
