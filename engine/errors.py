"""Exceptions the engine raises at its boundaries, each naming what to fix."""


class ModelLoadError(ValueError):
    """A model directory is missing a file, or holds something the engine cannot run."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture outside the supported families."""


class JobRejected(ValueError):
    """A job can never run on this generator (too long, too large for the cache, bad settings)."""


class QueueFull(RuntimeError):
    """enqueue() was called with max_pending jobs already waiting; retry later (backpressure)."""


class AdaptersBusy(RuntimeError):
    """enqueue() found every resident adapter slot (max_loras) held by a live job of another adapter:
    retry once one of them ends (vLLM keeps such a request waiting; the worker loop does too)."""


class AdapterLoadError(ValueError):
    """A LoRA adapter directory the engine refuses: a missing or unreadable file, a shape that does
    not fit the base model, an unknown target module, a rank past the limit, an unsupported option."""
