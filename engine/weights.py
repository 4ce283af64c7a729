"""Load a checkpoint into CausalLM: an HF directory of safetensors (single
file or sharded with an index) or a single GGUF file.

Each format is a source of (HF tensor name, tensor) pairs; one assignment
step fuses q/k/v and gate/up, stacks MoE experts as they stream in and checks
that nothing is missing, so both formats get the same shape and completeness
checks.

quantize="int8" / "int4" keeps the attention and dense MLP projections
(qkv_proj, o_proj, gate_up_proj, down_proj) quantized, weight-only
(engine/quantized_linear.py): they are swapped for QuantizedLinear while the
model is still on the meta device, so only the packed buffers are ever
allocated, and each checkpoint tensor is quantized into its rows of the fused
projection as it streams in (per-row quantization: the same as quantizing the
fused matrix). int8 has one scale per output channel from a safetensors
checkpoint (the fastest CPU kernels need that) and one per 32 columns from a
GGUF file, whose Q8_0 blocks then map exactly; GGUF's Q4_0 / Q4_1 / Q4_K
blocks go into int4 without expansion (engine/gguf_file.py). What stays in
the model's dtype, and why:

- embed_tokens: a row gather, no matmul to save; its bytes are read one row
  per token, not whole per step;
- lm_head: the logits are what sampling and greedy decoding compare, and the
  layer most sensitive to weight error (llama.cpp keeps output.weight at 6 or
  8 bits even in its 4-bit files); tied models share it with embed_tokens;
- norms, biases, the MoE router (tiny, and routing flips on small errors);
- MoE experts (Mixtral, Qwen3-MoE): stacked [E, 2I, H] parameters behind a
  per-expert dispatch that has no quantized path yet; they load in full
  precision and a warning says so (attention is still quantized).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.gguf_file import GGUF_GROUP_SIZE, is_gguf, open_gguf
from engine.lora.targets import TARGETS
from engine.model import CausalLM
from engine.quantized_linear import QUANTIZE_FORMATS, QuantizedLinear, QuantizedWeight, quantize_linears
from engine.vision.checkpoint import language_model_name

log = logging.getLogger(__name__)

# HF sub-module name -> (our fused parameter's module name, shard index in the fusion): the
# projections whose engine linear has another name (the one table of where each sits, LoRA's too)
_FUSED = {hf: place for hf, place in TARGETS.items() if place[0] != hf}
# The dense MLP's linears as PEFT and HF name them (TARGETS); Qwen3-MoE's experts keep these names
_GATE_UP_DOWN = ("gate_proj", "up_proj", "down_proj")
_HF_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": _GATE_UP_DOWN}
# MoE experts: HF per-expert tensor -> (our stacked parameter, shard in its rows), placed as the dense MLP's
_EXPERT = {name: TARGETS[dense] for names in _HF_EXPERT_NAMES.values() for name, dense in zip(names, _GATE_UP_DOWN)}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are missing: {', '.join(missing)}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(path.glob("*.safetensors"))
    if others:
        return others
    raise ModelLoadError(f"no model.safetensors (or model.safetensors.index.json) in {path}")


def load_model(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    progress: Callable[[int, int], None] | None = None,
    quantize: str | None = None,
) -> CausalLM:
    """Build the model for the checkpoint's config without initialising weights
    (meta device), then fill it from the checkpoint. path is an HF directory or
    a .gguf file. dtype None means the checkpoint's (float32 for GGUF); a name
    ("bfloat16") works too. progress(done, total) counts shards, or tensors
    for GGUF. quantize None keeps every weight in dtype (a GGUF file is
    dequantized); "int8" / "int4" keeps the linear layers quantized (see the
    module docstring)."""
    if quantize is not None and quantize not in QUANTIZE_FORMATS:
        raise ModelLoadError(
            f"quantize={quantize!r} is not supported; use None (weights in the model's dtype), "
            + " or ".join(repr(f) for f in QUANTIZE_FORMATS)
        )
    path = Path(path)
    gguf = open_gguf(path) if is_gguf(path) else None
    raw_config = gguf.config_dict() if gguf is not None else None
    config = ModelConfig.from_dict(raw_config) if raw_config is not None else ModelConfig.from_dir(path)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype {dtype!r} is not supported; use one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
    dtype = dtype or _DTYPES.get(config.torch_dtype, torch.float32)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(config)
        if quantize is not None:
            # int8 per output channel from full-precision checkpoints (the faster CPU kernels);
            # a GGUF file's 32-value blocks map onto groups of 32 (engine/gguf_file.py)
            _quantize_layers(model, quantize, GGUF_GROUP_SIZE if gguf is not None else None, path)
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.reset_buffers(device)
    if gguf is not None:
        assert raw_config is not None, "a GGUF file's config comes from its metadata"
        assign_weights(model, gguf.hf_tensors(dtype, raw_config, progress, quantize), str(path))
    else:
        # a vision-language checkpoint: its language model's tensors, renamed; the vision tower's skipped
        rename = language_model_name if config.vision_language else None
        assign_weights(model, safetensors_tensors(path, progress, rename), str(path))
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            module.finalize()
    return model.eval()


def _quantize_layers(model: CausalLM, quantize: str, group_size: int | None, path: Path) -> None:
    """Swap the projections for empty QuantizedLinear layers (still on meta)."""
    try:
        quantize_linears(model, quantize, group_size)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: quantize={quantize!r}: {exc}") from exc
    if model.config.num_experts:
        log.warning(
            "%s: quantize=%r leaves the %d MoE experts of each sparse layer in %s (no quantized expert "
            "kernel yet); attention and dense MLP layers are quantized", path, quantize,
            model.config.num_experts, model.embed_tokens.weight.dtype,
        )


def safetensors_tensors(
    path: Path,
    progress: Callable[[int, int], None] | None = None,
    rename: Callable[[str], str | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every tensor of an HF directory's shards, one at a time; with `rename`, each
    name as it maps it, and the tensors it maps to None are never read."""
    files = checkpoint_files(path)
    for file_number, file in enumerate(files, start=1):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                name = hf_name if rename is None else rename(hf_name)
                if name is not None:
                    yield name, f.get_tensor(hf_name)
        if progress is not None:
            progress(file_number, len(files))


def assign_weights(
    model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor | QuantizedWeight]], where: str
) -> None:
    """Copy every (HF name, tensor) into the model, then check nothing is missing.
    A QuantizedLinear's weight is quantized into its rows (or copied, for a
    QuantizedWeight); a QuantizedWeight for a plain parameter is dequantized."""
    params = dict(model.named_parameters(remove_duplicate=False))
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    config = model.config
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    fused_sizes = {
        "qkv_proj": [q_size, kv_size, kv_size],
        "gate_up_proj": [config.intermediate_size, config.intermediate_size],
        "experts.gate_up_proj": [config.moe_intermediate_size, config.moe_intermediate_size],
        "experts.down_proj": [config.hidden_size],
    }
    loaded: set[str] = set()
    for hf_name, tensor in tensors:
        if hf_name.endswith(_IGNORED_SUFFIXES):
            continue
        target, expert, offset, size = _target(hf_name, fused_sizes)
        layer = quantized.get(target.removesuffix(".weight")) if target.endswith(".weight") else None
        if layer is not None:
            _load_quantized(layer, tensor, offset, size, hf_name, where)
            loaded.add(hf_name)
            continue
        if target not in params or (expert is not None and expert >= config.num_experts):
            raise ModelLoadError(f"{where}: unexpected tensor {hf_name!r} for a {config.family} model")
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.dequantize(params[target].dtype)
        destination = params[target].data if expert is None else params[target].data[expert]
        if size is not None:
            destination = destination.narrow(0, offset, size)
        if destination.shape != tensor.shape:
            raise ModelLoadError(
                f"{where}: {hf_name} has shape {tuple(tensor.shape)}, the config implies "
                f"{tuple(destination.shape)}"
            )
        destination.copy_(tensor)
        loaded.add(hf_name)
    expected = set(_expected_hf_names(model, fused_sizes))
    missing = sorted(expected - loaded)
    if config.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{where}: checkpoint lacks {len(missing)} tensors: {shown}")


def _load_quantized(
    layer: QuantizedLinear,
    tensor: torch.Tensor | QuantizedWeight,
    offset: int,
    size: int | None,
    hf_name: str,
    where: str,
) -> None:
    rows = layer.out_features if size is None else size
    shape = (tensor.out_features, tensor.in_features) if isinstance(tensor, QuantizedWeight) else tuple(tensor.shape)
    if shape != (rows, layer.in_features):
        raise ModelLoadError(
            f"{where}: {hf_name} has shape {shape}, the config implies {(rows, layer.in_features)}"
        )
    try:
        layer.load_rows(offset, tensor)
    except ValueError as exc:
        raise ModelLoadError(f"{where}: {hf_name}: {exc}") from exc


def _target(hf_name: str, fused_sizes: dict[str, list[int]]) -> tuple[str, int | None, int, int | None]:
    """Map an HF tensor name to (our parameter name, expert index or None, row
    offset, rows), rows None for a whole copy."""
    name = hf_name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
    parts = name.split(".")
    at = parts.index("experts") if "experts" in parts else -1
    if 0 <= at < len(parts) - 2 and parts[at + 1].isdigit() and parts[at + 2] in _EXPERT:
        # layers.N.mlp.experts.E.{w1|gate_proj|...}.weight -> layers.N.mlp.experts.{gate_up_proj|down_proj}[E]
        fused, shard = _EXPERT[parts[at + 2]]
        sizes = fused_sizes[f"experts.{fused}"]
        target = ".".join([*parts[: at + 1], fused])
        return target, int(parts[at + 1]), sum(sizes[:shard]), sizes[shard]
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            sizes = fused_sizes[fused]
            parts[i] = fused
            return ".".join(parts), None, sum(sizes[:shard]), sizes[shard]
    return name, None, 0, None


def _expected_hf_names(model: CausalLM, fused_sizes: dict[str, list[int]]) -> Iterator[str]:
    """Every tensor name the checkpoint must hold, in its own family's spelling."""
    config = model.config
    # Phi-3 checkpoints store q/k/v and gate/up fused already
    unfused = {fused: [hf for hf, (f, _) in _FUSED.items() if f == fused] for fused in ("qkv_proj", "gate_up_proj")}
    if config.family == "phi3":
        unfused = {}
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    names += [f"{name}.weight" for name, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    for name in names:
        prefix = "" if name.startswith("lm_head") else "model."
        if config.family == "mixtral":
            name = name.replace(".mlp.", ".block_sparse_moe.")
        parts = name.split(".")
        if "experts" in parts:
            yield from _expert_names(prefix + ".".join(parts[:-1]), parts[-1], config)
            continue
        fused = next((p for p in parts if p in unfused), None)
        if fused is None:
            yield prefix + name
            continue
        for hf in unfused[fused]:
            yield prefix + name.replace(fused, hf)


def _expert_names(experts: str, stacked: str, config: ModelConfig) -> Iterator[str]:
    gate, up, down = _HF_EXPERT_NAMES[config.family]
    for e in range(config.num_experts):
        for hf in (gate, up) if stacked == "gate_up_proj" else (down,):
            yield f"{experts}.{e}.{hf}.weight"
