"""Hand-built sequences for the scheduler and KV-manager tests: no model, no tokenizer files."""

from __future__ import annotations

from collections.abc import Sequence as Seq

from engine.detokenizer import IncrementalDetokenizer
from engine.job import Job
from engine.sequence import Sequence


class CharDecoder:
    """Token id n decodes to chr(n): enough for a detokenizer nobody reads here."""

    def decode(self, ids: Seq[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def make_sequence(serial: int, prompt: list[int], max_new_tokens: int = 8) -> Sequence:
    job = Job(prompt, max_new_tokens, stop_conditions=[])
    job.serial = serial
    return Sequence(
        job=job,
        serial=serial,
        token_ids=list(prompt),
        num_prompt_tokens=len(prompt),
        stop_token_ids=frozenset(),
        detokenizer=IncrementalDetokenizer(CharDecoder()),
        stop_matcher=None,
        rng=None,
        time_enqueued=0.0,
    )
