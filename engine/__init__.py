"""genq's generation engine: a paged, continuous-batching generator with a
job API after exllamav2's dynamic generator. No Redis, no Celery here.

Exports load on first use (PEP 562), so a light submodule (engine.config, engine.memory_plan)
imports without torch and the generator's dependencies: `genq plan` answers in a second."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.async_generator import AsyncGenerator, AsyncJob
    from engine.constraint_spec import Constraint
    from engine.embeddings import Embedding
    from engine.engine_config import CacheConfig, EngineConfig, SchedulerConfig, SpeculativeConfig
    from engine.errors import (
        AdaptersBusy,
        JobRejected,
        ModelLoadError,
        QueueFull,
        UnsupportedArchitectureError,
    )
    from engine.generator import Generator, GeneratorStats
    from engine.job import Job
    from engine.outputs import EngineOutput, FinishReason, Stage
    from engine.sampler_settings import SamplerSettings
    from engine.tokenizer import Tokenizer

_MODULES = {
    "AsyncGenerator": "engine.async_generator",
    "AsyncJob": "engine.async_generator",
    "Constraint": "engine.constraint_spec",
    "Embedding": "engine.embeddings",
    "CacheConfig": "engine.engine_config",
    "EngineConfig": "engine.engine_config",
    "SchedulerConfig": "engine.engine_config",
    "SpeculativeConfig": "engine.engine_config",
    "AdaptersBusy": "engine.errors",
    "JobRejected": "engine.errors",
    "ModelLoadError": "engine.errors",
    "QueueFull": "engine.errors",
    "UnsupportedArchitectureError": "engine.errors",
    "Generator": "engine.generator",
    "GeneratorStats": "engine.generator",
    "Job": "engine.job",
    "EngineOutput": "engine.outputs",
    "FinishReason": "engine.outputs",
    "Stage": "engine.outputs",
    "SamplerSettings": "engine.sampler_settings",
    "Tokenizer": "engine.tokenizer",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AsyncGenerator",
    "AsyncJob",
    "CacheConfig",
    "Constraint",
    "Embedding",
    "EngineConfig",
    "EngineOutput",
    "FinishReason",
    "Generator",
    "GeneratorStats",
    "Job",
    "AdaptersBusy",
    "JobRejected",
    "ModelLoadError",
    "QueueFull",
    "SamplerSettings",
    "SchedulerConfig",
    "SpeculativeConfig",
    "Stage",
    "Tokenizer",
    "UnsupportedArchitectureError",
]
