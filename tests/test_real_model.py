"""The real model (SmolLM2-135M-Instruct, Q4_1 GGUF from PyPI) end to end:
greedy chat answers in several languages token-identical to transformers
loading the same file, and the same text through a real worker and through
the gateway's OpenAI endpoint."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import Generator, Job
from producer.client import GenqClient
from tests.gateway_service import MODEL

MAX_NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Give me two tips for sleeping better.",
    "Write a Python function that reverses a string.",
    "Quelle est la plus haute montagne d'Europe ?",
    "Wie viele Tage hat ein Schaltjahr?",
    "¿Por qué el cielo es azul?",
    "用一句话介绍长城。",
    "日本の首都はどこですか？",
    "Что такое фотосинтез?",
]


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def model_dir(smollm2_gguf: Path) -> Path:
    """The model the imported worker fixture serves: the real .gguf file."""
    return smollm2_gguf


@pytest.fixture(scope="module")
def engine_answers(smollm2_gguf: Path) -> dict[str, dict]:
    """Every question's greedy answer from the engine alone, all in one continuous batch."""
    generator = Generator.from_pretrained(smollm2_gguf, cache_tokens=8192)
    for question in QUESTIONS:
        prompt = generator.tokenizer.encode_chat(conversation(question))
        generator.enqueue(Job(prompt, MAX_NEW_TOKENS, identifier=question))
    answers: dict[str, dict] = {}
    while generator.num_remaining_jobs():
        for result in generator.iterate():
            if result["eos"]:
                answers[result["identifier"]] = {
                    "prompt": generator.tokenizer.encode_chat(conversation(result["identifier"])),
                    "ids": result["completion_ids"],
                    "text": result["full_completion"],
                    "eos_ids": generator.tokenizer.eos_token_ids,
                }
    return answers


def test_greedy_chat_answers_match_transformers_on_the_same_gguf(smollm2_gguf: Path, engine_answers: dict):
    hf = AutoModelForCausalLM.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name,
                                              dtype=torch.float32).eval()
    for question, answer in engine_answers.items():
        ids = torch.tensor([answer["prompt"]])
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS,
                              do_sample=False, eos_token_id=answer["eos_ids"], pad_token_id=answer["eos_ids"][0])
        assert answer["ids"] == out[0, ids.shape[1]:].tolist(), question
    english = engine_answers[QUESTIONS[0]]["text"]
    assert "Paris" in english


def test_worker_and_openai_endpoint_answer_as_the_engine_alone(
    engine_answers: dict, genq: GenqClient, oai: openai.OpenAI  # noqa: F811 (the imported fixtures)
):
    for question in QUESTIONS[:4]:
        expected = engine_answers[question]["text"]
        result = genq.submit({"messages": conversation(question), "max_new_tokens": MAX_NEW_TOKENS}).result(
            timeout=300)
        assert result.text == expected, question
        reply = oai.chat.completions.create(model=MODEL, messages=conversation(question), max_tokens=MAX_NEW_TOKENS,
                                            temperature=0)
        assert reply.choices[0].message.content == expected, question
