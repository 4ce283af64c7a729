"""The real model (SmolLM2-135M-Instruct, Q4_1 GGUF) loaded with quantize="int4":
its 4-bit blocks go straight into the quantized layers, and the answers are
those of the same file dequantized to fp32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import Generator
from engine.cache import KVCache
from engine.model import CausalLM
from engine.tokenizer import Tokenizer
from engine.weights import load_model
from tests.engine_runs import greedy_completions
from tests.test_quantized_loading import all_logits, linear_weight_bytes


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread: on a machine shared with other test runs, a team of two threads
    waits at every op for a descheduled member (measured: 6 to 10 times slower here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "Why is the sky blue?"]
NEW_TOKENS = 16


def _greedy(model: CausalLM, tokenizer: Tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    cache = KVCache.allocate(model.config, 64, 16, torch.float32, "cpu")
    return greedy_completions(Generator(model, cache, tokenizer), prompts, NEW_TOKENS)


@pytest.mark.usefixtures("one_thread")
def test_smollm2_q4_1_in_int4_generates_as_its_dequantized_weights(smollm2_gguf: Path):
    """Q4_1 maps onto int4 exactly and, in fp32 on CPU, the layer dequantizes to the very
    floats the plain load expands and calls the same F.linear: identical logits, so
    greedy answers agree token for token (48 of 48), at under a fifth of the linear
    layers' bytes."""
    tokenizer = Tokenizer.from_pretrained(smollm2_gguf)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    full = load_model(smollm2_gguf)
    int4 = load_model(smollm2_gguf, quantize="int4")
    ratio = linear_weight_bytes(int4) / linear_weight_bytes(full)
    assert 1 / 8 <= ratio <= 0.19, ratio  # 4-bit values plus fp32 scales and offsets per 32: 6 bits a weight
    assert torch.equal(all_logits(int4, prompts[0]), all_logits(full, prompts[0]))
    expected, got = _greedy(full, tokenizer, prompts), _greedy(int4, tokenizer, prompts)
    assert got == expected
    assert "Paris" in tokenizer.decode(got[0])
