"""genq's generation engine: a paged, continuous-batching generator with a
job API after exllamav2's dynamic generator. No Redis, no Celery here."""

from engine.async_generator import AsyncGenerator, AsyncJob
from engine.constraints import Constraint
from engine.embeddings import Embedding
from engine.errors import (
    JobRejected,
    ModelLoadError,
    QueueFull,
    UnsupportedArchitectureError,
)
from engine.generator import Generator, GeneratorStats
from engine.job import Job
from engine.outputs import EngineOutput, FinishReason, Stage
from engine.sampling import SamplerSettings
from engine.tokenizer import Tokenizer

__all__ = [
    "AsyncGenerator",
    "AsyncJob",
    "Constraint",
    "Embedding",
    "EngineOutput",
    "FinishReason",
    "Generator",
    "GeneratorStats",
    "Job",
    "JobRejected",
    "ModelLoadError",
    "QueueFull",
    "SamplerSettings",
    "Stage",
    "Tokenizer",
    "UnsupportedArchitectureError",
]
