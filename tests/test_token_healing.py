"""Token healing: the prompt's last token is regenerated among the tokens that begin with its text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import Constraint, EngineOutput, Generator, Job, JobRejected
from tests.engine_runs import run_streamed


def final_result(generator: Generator, job: Job) -> EngineOutput:
    """Run the job alone; its final result, once the streamed chunks are checked to add up to it."""
    final, chunks = run_streamed(generator, job)
    assert "".join(chunks) == final.full_completion
    return final


def healing_prompt(generator: Generator) -> list[int]:
    """A prompt whose last token is a proper prefix of several other vocabulary pieces."""
    tokenizer = generator.tokenizer
    pieces = [tokenizer.id_to_token(t) or "" for t in range(generator.model.config.vocab_size)]
    for token in range(100, len(pieces)):
        piece = pieces[token]
        if len(piece) >= 2 and sum(1 for other in pieces if other.startswith(piece)) >= 4:
            return [*range(3, 20), token]
    raise AssertionError("no vocabulary piece with extensions to heal")


@torch.inference_mode()
def test_the_healed_token_is_the_model_s_best_extension_and_greedy_goes_on_from_it(llama_dir: Path) -> None:
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8)
    tokenizer = generator.tokenizer
    prompt = healing_prompt(generator)
    piece = tokenizer.id_to_token(prompt[-1])
    final = final_result(generator, Job(prompt, 8, stop_conditions=[], token_healing=True))
    ids = final.completion_ids
    # the reference: Hugging Face's logits for the prompt without its last token, best extension first
    hf = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    logits = hf(torch.tensor([prompt[:-1]])).logits[0, -1]
    candidates = [t for t in range(logits.shape[0]) if (tokenizer.id_to_token(t) or "").startswith(piece)]
    expected = [candidates[int(logits[candidates].argmax())]]
    while len(expected) < 8:
        expected.append(int(hf(torch.tensor([prompt[:-1] + expected])).logits[0, -1].argmax()))
    assert ids == expected
    assert final.prompt_tokens == len(prompt) - 1 and final.new_tokens == 8
    # only what the healed token adds to the prompt's text is emitted
    full = tokenizer.decode(prompt[:-1] + ids)
    assert full.startswith(tokenizer.decode(prompt))
    assert final.full_completion == full[len(tokenizer.decode(prompt)) :]


def test_without_healing_the_prompt_is_kept_whole(llama_dir: Path) -> None:
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8)
    prompt = healing_prompt(generator)
    healed = final_result(generator, Job(prompt, 4, stop_conditions=[], token_healing=True))
    plain = final_result(generator, Job(prompt, 4, stop_conditions=[]))
    assert plain.prompt_tokens == len(prompt)
    assert healed.completion_ids != plain.completion_ids


def test_a_one_token_prompt_is_not_healed(llama_dir: Path) -> None:
    generator = Generator.from_pretrained(llama_dir, cache_tokens=2048, page_size=8)
    healed = final_result(generator, Job([42], 4, stop_conditions=[], token_healing=True))
    plain = final_result(generator, Job([42], 4, stop_conditions=[]))
    assert healed.completion_ids == plain.completion_ids and healed.prompt_tokens == 1


def test_token_healing_with_a_constraint_is_refused(llama_dir: Path) -> None:
    generator = Generator.from_pretrained(llama_dir, cache_tokens=1024, page_size=8)
    with pytest.raises(JobRejected, match="token_healing"):
        generator.enqueue(Job([1, 2, 3], 4, token_healing=True, constraint=Constraint.regex("[a-z]+")))
