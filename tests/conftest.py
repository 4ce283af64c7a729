"""Shared fixtures: tiny random-weight model directories, made once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.tiny_model import make_tiny_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make(family, **options) -> model dir; identical requests share one directory."""
    made: dict[tuple, Path] = {}

    def make(family: str = "llama", **options: object) -> Path:
        key = (family, tuple(sorted(options.items())))
        if key not in made:
            made[key] = make_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family=family, **options)
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")
