"""Load HF safetensors checkpoints (single file or sharded with an index)
into CausalLM, fusing q/k/v and gate/up as they stream in."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError
from engine.model import CausalLM
from engine.rope import inverse_frequencies

# HF sub-module name -> (our fused parameter's module name, shard index in the fusion)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
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
) -> CausalLM:
    """Build the model for config.json without initialising weights (meta
    device), then fill it from the checkpoint. dtype None means config.json's;
    a name ("bfloat16") works too."""
    path = Path(path)
    config = ModelConfig.from_dir(path)
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
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = inverse_frequencies(config.rope, config.head_dim).to(device)
    load_weights(model, path, progress)
    return model.eval()


def load_weights(
    model: CausalLM, path: Path, progress: Callable[[int, int], None] | None = None
) -> None:
    """Copy every checkpoint tensor into the model, then check nothing is missing."""
    params = dict(model.named_parameters(remove_duplicate=False))
    config = model.config
    q_size = config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * config.head_dim
    fused_sizes = {
        "qkv_proj": [q_size, kv_size, kv_size],
        "gate_up_proj": [config.intermediate_size, config.intermediate_size],
    }
    loaded: set[str] = set()
    files = checkpoint_files(path)
    for file_number, file in enumerate(files, start=1):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                target, offset, size = _target(hf_name, fused_sizes)
                if target not in params:
                    raise ModelLoadError(f"{file.name}: unexpected tensor {hf_name!r} for a {config.family} model")
                tensor = f.get_tensor(hf_name)
                param = params[target]
                destination = param.data if size is None else param.data.narrow(0, offset, size)
                if destination.shape != tensor.shape:
                    raise ModelLoadError(
                        f"{file.name}: {hf_name} has shape {tuple(tensor.shape)}, config.json implies "
                        f"{tuple(destination.shape)}"
                    )
                destination.copy_(tensor)
                loaded.add(hf_name)
        if progress is not None:
            progress(file_number, len(files))
    expected = set(_expected_hf_names(model, fused_sizes))
    missing = sorted(expected - loaded)
    if config.tie_word_embeddings:
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise ModelLoadError(f"{path}: checkpoint lacks {len(missing)} tensors: {shown}")


def _target(hf_name: str, fused_sizes: dict[str, list[int]]) -> tuple[str, int, int | None]:
    """Map an HF tensor name to (our parameter name, row offset, rows) or rows None for a whole copy."""
    name = hf_name.removeprefix("model.")
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in _FUSED:
            fused, shard = _FUSED[part]
            sizes = fused_sizes[fused]
            parts[i] = fused
            return ".".join(parts), sum(sizes[:shard]), sizes[shard]
    return name, 0, None


def _expected_hf_names(model: CausalLM, fused_sizes: dict[str, list[int]]) -> Iterator[str]:
    unfused = {fused: [hf for hf, (f, _) in _FUSED.items() if f == fused] for fused in fused_sizes}
    for name, _ in model.named_parameters(remove_duplicate=False):
        prefix = "" if name.startswith("lm_head") else "model."
        parts = name.split(".")
        fused = next((p for p in parts if p in unfused), None)
        if fused is None:
            yield prefix + name
            continue
        for hf in unfused[fused]:
            yield prefix + name.replace(fused, hf)
