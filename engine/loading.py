"""from_pretrained's work: load the model(s) and the tokenizer, size and allocate the paged caches."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine import device_info as devices
from engine.cache import KVCache
from engine.engine_config import DEFAULT_CPU_CACHE_BYTES, DEFAULT_MAX_BATCH_SIZE, EngineConfig
from engine.int8_dynamic import check_cpu_int8, int8_dynamic_linears
from engine.memory_plan import cuda_cache_bytes
from engine.model import CausalLM
from engine.tokenizer import Tokenizer
from engine.weights import load_model

if TYPE_CHECKING:
    from engine.vision.images import ImageEncoder

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedEngine:
    model: CausalLM
    cache: KVCache
    tokenizer: Tokenizer
    draft_model: CausalLM | None = None
    draft_cache: KVCache | None = None
    vision: ImageEncoder | None = None  # a vision-language checkpoint's tower and image processor


def load_engine(path: str | Path, device: torch.device, dtype: torch.dtype | str | None, config: EngineConfig,
                progress: Callable[[int, int], None] | None = None,
                draft_model_path: str | Path | None = None, mmproj: str | Path | None = None) -> LoadedEngine:
    """The cache holds config.cache.cache_tokens, else cache_memory bytes' worth, else a device
    default (1 GiB on CPU; on CUDA engine/memory_plan.py's budget: gpu_memory_utilization of the
    GPU less what the weights and everything else use and a step's reserve), never more than
    max_batch_size * max_seq_len tokens would use. cache_dtype stores K/V as the model's dtype
    ("auto") or quantized (kernels.KV_CACHE_DTYPES), for both caches; the same memory then holds
    proportionally more tokens. config.quantize keeps the main model's linear layers weight-only
    quantized (engine/quantized_linear.py; a GGUF 4/8-bit file maps onto it); config.cpu_int8 then
    runs them as int8 dynamic-quantized matmuls (CPU and fp32 only: engine/int8_dynamic.py). A
    vision-language directory's tower and image processor load too, in the model's dtype
    (engine/vision/images.py); without preprocessor_config.json it runs text only. mmproj names a
    llama.cpp mmproj GGUF whose tower and processor go with the text model (engine/vision/mmproj.py)."""
    if config.cpu_int8:
        check_cpu_int8(device)
    tokenizer = Tokenizer.from_pretrained(path)
    model = load_model(path, device, dtype, progress, config.quantize)
    if config.cpu_int8:
        check_cpu_int8(device, model.embed_tokens.weight.dtype)
        log.info("cpu_int8: %d projections run as int8 dynamic matmuls", len(int8_dynamic_linears(model)))
    cache_config = config.cache
    page_size = cache_config.page_size
    model_dtype = model.embed_tokens.weight.dtype
    per_token = KVCache.bytes_per_token(model.config, model_dtype, cache_config.cache_dtype)
    cache_tokens = cache_config.cache_tokens
    if cache_tokens is None:
        memory = cache_config.cache_memory if cache_config.cache_memory is not None else default_cache_bytes(
            device, model, config)
        max_seq_len = config.scheduler.max_seq_len or model.config.max_context_len
        max_batch = config.scheduler.max_batch_size or DEFAULT_MAX_BATCH_SIZE
        cache_tokens = min(memory // per_token, max_seq_len * max_batch)
    num_pages = max(1, -(-cache_tokens // page_size))
    cache = KVCache.allocate(model.config, num_pages, page_size, model_dtype, device, cache_config.cache_dtype)
    draft_model = draft_cache = None
    if draft_model_path is not None:
        draft_model = load_model(draft_model_path, device, dtype)
        draft_cache = KVCache.allocate(draft_model.config, num_pages, page_size, draft_model.embed_tokens.weight.dtype,
                                       device, cache_config.cache_dtype)
    log.info(
        "loaded %s (%s, %s) with a %s KV cache of %d pages x %d tokens (%.1f MiB)",
        path, model.config.family, model_dtype, cache.cache_dtype, num_pages, page_size,
        num_pages * page_size * per_token / 2**20,
    )
    vision = None
    if mmproj is not None:
        from engine.vision.images import ImageEncoder  # Pillow: only vision-language models need it
        from engine.vision.mmproj import load_mmproj

        vision = ImageEncoder(*load_mmproj(mmproj, model.config.hidden_size, tokenizer, device, model_dtype))
    elif model.config.vision_language is not None and Path(path).is_dir():
        if (Path(path) / "preprocessor_config.json").is_file():
            from engine.vision.images import ImageEncoder  # Pillow: only vision-language models need it

            vision = ImageEncoder.from_pretrained(path, device, model_dtype)
        else:
            log.warning("%s has no preprocessor_config.json: its language model runs text only", path)
    return LoadedEngine(model, cache, tokenizer, draft_model, draft_cache, vision)


def default_cache_bytes(device: torch.device, model: CausalLM, config: EngineConfig,
                        device_info: devices.DeviceInfo | None = None) -> int:
    """The cache's bytes when the configuration names none (see load_engine); device_info answers for
    the GPU, by default the driver (engine/device_info.py)."""
    if device.type == "cuda":
        info = device_info or devices.current(device)
        return cuda_cache_bytes(model.config, model.embed_tokens.weight.element_size(), info.total_memory,
                                info.free_memory, config)
    return DEFAULT_CPU_CACHE_BYTES


def check_draft_pair(model: CausalLM, cache: KVCache, draft_model: CausalLM | None, draft_cache: KVCache | None
                     ) -> None:
    """A draft model shares the main cache's page tables and vocabulary: ValueError if it cannot."""
    if draft_model is None:
        return
    draft_shape = None if draft_cache is None else (draft_cache.num_pages, draft_cache.page_size)
    if draft_shape != (cache.num_pages, cache.page_size):
        raise ValueError("draft_cache must have the main cache's number of pages and page size")
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"draft model vocab_size {draft_model.config.vocab_size} != main model's "
                         f"{model.config.vocab_size}")
