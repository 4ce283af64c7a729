"""A step's encoder inputs, as vLLM v1 schedules them with the step: the deferred embeddings (images
before their tower ran, engine/vision/images.py) that the step's prompt chunks still need are encoded
before the forward, in one call per encoder over every job of the step, so the images of a step's
admissions go through the vision tower together. An image the prefix cache already holds the pages
after is not encoded (a later recompute, after a preemption, encodes it then). If the call fails, each
job's images are encoded on their own, so that a job whose images cannot be encoded fails alone.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import replace

from engine.embeddings import DeferredEmbedding, DeferredEncoder
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.sequence import Sequence


def encode_step(schedule: SchedulerOutput) -> tuple[SchedulerOutput, dict[int, str]]:
    """Encode what the step's prompt chunks need: the step without the jobs whose embeddings failed,
    and serial -> error for those (each ends alone)."""
    failed = encode_scheduled(schedule.scheduled)
    if not failed:
        return schedule, failed
    return replace(schedule, scheduled=tuple(i for i in schedule.scheduled if i.sequence.serial not in failed),
                   started=tuple(s for s in schedule.started if s.serial not in failed)), failed


def encode_scheduled(scheduled: Seq[ScheduledSequence]) -> dict[int, str]:
    """Encode the deferred embeddings the scheduled prompt chunks need; serial -> error for each job
    whose embeddings could not be encoded."""
    by_encoder: dict[int, tuple[DeferredEncoder, dict[int, list[DeferredEmbedding]]]] = {}
    for item in scheduled:
        sequence = item.sequence
        if not sequence.job.embeddings:
            continue  # a text-only job (every row of a text-only step): nothing to encode
        for embedding in _needed(sequence):
            jobs = by_encoder.setdefault(id(embedding.encoder), (embedding.encoder, {}))[1]
            jobs.setdefault(sequence.serial, []).append(embedding)
    failed: dict[int, str] = {}
    for encoder, jobs in by_encoder.values():
        try:
            encoder.encode_deferred([embedding for embeddings in jobs.values() for embedding in embeddings])
        except Exception:  # noqa: BLE001 - find the job at fault below
            for serial, embeddings in jobs.items():
                try:
                    encoder.encode_deferred(embeddings)
                except Exception as error:  # noqa: BLE001 - a job whose images fail fails alone
                    failed[serial] = f"embeddings: encoding failed: {type(error).__name__}: {error}"
    return failed


def _needed(sequence: Sequence) -> list[DeferredEmbedding]:
    """The sequence's deferred embeddings not encoded yet whose rows lie past what is computed."""
    if sequence.num_computed >= sequence.num_prompt_tokens:
        return []
    pending = [e for e in sequence.job.embeddings if isinstance(e, DeferredEmbedding) and not e.encoded]
    return [e for e in pending if sequence.token_ids.index(e.first_id) + e.rows > sequence.num_computed]
