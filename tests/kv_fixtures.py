"""Hand-built sequences for the scheduler and KV-manager tests: no model, no tokenizer files."""

from __future__ import annotations

from engine.job import Job
from engine.sequence import Sequence


def make_sequence(serial: int, prompt: list[int], max_new_tokens: int = 8) -> Sequence:
    job = Job(prompt, max_new_tokens, stop_conditions=[])
    job.serial = serial
    return Sequence(job=job, serial=serial, token_ids=list(prompt), num_prompt_tokens=len(prompt), time_enqueued=0.0)
