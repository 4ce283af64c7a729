"""Exceptions the engine raises at its boundaries, each naming what to fix."""


class ModelLoadError(ValueError):
    """A model directory is missing a file, or holds something the engine cannot run."""


class UnsupportedArchitectureError(ModelLoadError):
    """config.json names an architecture outside the supported families."""


class JobRejected(ValueError):
    """A job can never run on this generator (too long, too large for the cache, bad settings)."""


class QueueFull(RuntimeError):
    """enqueue() was called with max_pending jobs already waiting; retry later (backpressure)."""
