"""A model whose every layer uses a sliding window gives back the pages that
fall out of the window while it generates. (That its output still equals
transformers' is test_engine_vs_transformers' mistral-sliding-window case.)"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

from engine import Generator, Job

PAGE = 8
WINDOW = 12


def test_pages_out_of_the_window_are_released_while_generating(tiny_model_factory: Callable[..., Path]):
    path = tiny_model_factory("mistral", sliding_window=WINDOW)
    generator = Generator.from_pretrained(path, cache_tokens=2048, page_size=PAGE, max_chunk_size=32)
    rng = random.Random(3)
    vocab = generator.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (90, 61, 33)]
    for i, prompt in enumerate(prompts):
        generator.enqueue(Job(prompt, 24, stop_conditions=[], identifier=i))
    done: set[int] = set()
    most_held = 0
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                done.add(result["identifier"])
        held = [sum(1 for p in s.pages if p >= 0) for s in generator._sequences.values()]
        most_held = max([most_held, *held])
    # a sequence needs the pages of its last WINDOW positions, one page of slack at
    # each end, and the room of the step being scheduled (a 32-token chunk)
    # (keeping every page, the 90-token prompt alone would hold 15)
    assert most_held <= -(-WINDOW // PAGE) + 2 + 32 // PAGE
    assert done == {0, 1, 2} and generator.pool.num_used == 0

