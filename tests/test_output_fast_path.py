"""The output processor's one-token path (OutputProcessor._streamed) gives exactly the results of
its general path (_emit), on random token streams that end jobs by stop strings (with and without
min_new_tokens holding them), stop tokens and max_new_tokens."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from engine import Job
from engine.output_processor import OutputProcessor, ProcessedStep, StepTokens
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer


class GeneralOnly(OutputProcessor):
    """The processor with its one-token path off: every token takes the general path."""

    def _streamed(self, *_: Any) -> None:
        return None


class Counting(OutputProcessor):
    """The processor as the engine runs it, counting the results its one-token path made."""

    fast = 0

    def _streamed(self, *args: Any) -> Any:
        result = super()._streamed(*args)
        self.fast += result is not None
        return result


def streams(tokenizer: Tokenizer, seed: int) -> list[tuple[Job, list[int]]]:
    rng = random.Random(seed)
    vocab = tokenizer.vocab_size
    stop_token = min(tokenizer.eos_token_ids)
    out = []
    for i in range(24):
        prompt = [rng.randrange(5, vocab) for _ in range(rng.randint(2, 12))]
        tokens = [stop_token if rng.random() < 0.04 else rng.randrange(5, vocab) for _ in range(40)]
        stops: list[int | str] = [["e", "th"], ["a"], ["xyz"], []][i % 4]
        out.append((Job(prompt, rng.randint(3, 40), min_new_tokens=rng.choice([0, 0, 3]), stop_conditions=stops,
                        identifier=i), tokens))
    return out


def run(processor: OutputProcessor, tokenizer: Tokenizer, seed: int) -> list[dict[str, Any]]:
    live: dict[int, tuple[Sequence, list[int]]] = {}
    for serial, (job, tokens) in enumerate(streams(tokenizer, seed)):
        sequence = Sequence(job, serial, list(job.input_ids), len(job.input_ids), 0.0)
        processor.add(sequence, frozenset(tokenizer.eos_token_ids), None)
        live[serial] = sequence, tokens
    results: list[dict[str, Any]] = []
    for step in range(40):
        appended = []
        for sequence, tokens in live.values():
            sequence.append(tokens[step])
            appended.append(StepTokens(sequence, [tokens[step]]))
        processed: ProcessedStep = processor.process(appended, 1.0)
        results += [{k: v for k, v in r.as_dict().items() if k != "job" and not k.startswith("time")}
                    for r in processed.outputs]
        for finished in processed.finished:
            live.pop(finished.serial)
        for sequence, _ in live.values():  # the engine ends a job at a stop token or max_new_tokens
            job, generated = sequence.job, sequence.num_generated
            if generated >= job.max_new_tokens or (
                    sequence.output_ids[-1] in tokenizer.eos_token_ids and generated >= job.min_new_tokens):
                raise AssertionError("a job the engine ends was not finished by the output processor")
    return results


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_one_token_path_gives_the_general_paths_results(llama_dir: Path, seed: int):
    tokenizer = Tokenizer.from_pretrained(llama_dir)
    engine = Counting(tokenizer)
    fast = run(engine, tokenizer, seed)
    general = run(GeneralOnly(tokenizer), tokenizer, seed)
    assert fast == general
    assert engine.fast > len(fast) // 2  # most results came from the one-token path
    reasons = {r.get("eos_reason") for r in fast if r["eos"]}
    assert {"stop_string", "stop_token", "max_new_tokens"} <= reasons
