"""Shared fixtures: tiny random-weight model directories, a private redis-server.

The process helpers live in worker.processes (one copy for `genq dev`, the
tests and bench/)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import torch
from celery import Celery

from genq_dev.tiny_model import PRESETS, SPECIAL_TOKENS, make_tiny_model, write_tokenizer_files
from genq_dev.tiny_vlm import make_tiny_vlm
from tests.service import plain_client
from worker.processes import RedisServer

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


# Small shapes for checkpoints that transformers itself initialises (the families the
# project's tiny model maker does not write). initializer_range is raised from 0.02
# so attention is peaked and greedy argmax has clear margins, as in a trained model.
HF_SMALL = {
    **PRESETS["test"],
    "initializer_range": 0.2,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": SPECIAL_TOKENS.index("<|pad|>"),
}


def make_hf_model(out: Path, config_class: str, **config: object) -> Path:
    """A model dir whose random weights transformers initialised (fp32, seeded)
    and saved with save_pretrained, plus the tiny model maker's tokenizer files."""
    import transformers

    torch.manual_seed(0)
    hf_config = getattr(transformers, config_class)(**{**HF_SMALL, **config})
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    model.save_pretrained(out)
    write_tokenizer_files(out, hf_config.vocab_size, "llama", hf_config.max_position_embeddings)
    return out


@pytest.fixture(scope="session")
def hf_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """make(config_class, **config) -> make_hf_model's dir; identical requests share one directory."""
    made: dict[str, Path] = {}

    def make(config_class: str, **config: object) -> Path:
        key = repr((config_class, sorted(config.items())))
        if key not in made:
            made[key] = make_hf_model(tmp_path_factory.mktemp(f"hf-{config_class}"), config_class, **config)
        return made[key]

    return make


@pytest.fixture(scope="session")
def llama_dir(tiny_model_factory: Callable[..., Path]) -> Path:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real model (SmolLM2-135M-Instruct, Q4_1 GGUF), fetched once into GENQ_MODELS_DIR or .models/."""
    from genq_dev.demo_model import fetch_smollm2

    return fetch_smollm2()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A private redis-server owned by the test session, on a free port, with
    append-only persistence as deployed."""
    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (.ci/run installs it with apt)")
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture(scope="session")
def client(redis_url: str) -> Celery:
    """A Celery client that knows nothing of genq, on the session's Redis."""
    return plain_client(redis_url)


@pytest.fixture(scope="session")
def redis_client(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """kind ("llava" or "gemma3") -> a tiny random vision-language directory and transformers' model
    loaded from it (AutoModelForImageTextToText), made once per session."""
    made: dict[str, tuple[Path, Any]] = {}

    def make(kind: str) -> tuple[Path, Any]:
        if kind not in made:
            import transformers

            path = make_tiny_vlm(tmp_path_factory.mktemp(kind), kind)
            hf = transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
            made[kind] = path, hf
        return made[kind]

    return make


def _tiny_vlm_part(kind: str, part: int) -> Any:
    """A fixture giving tiny_vlm(kind)[part]: 0 the model directory, 1 transformers' model."""

    @pytest.fixture
    def fixture(tiny_vlm: Callable[[str], tuple[Path, Any]]) -> Any:
        return tiny_vlm(kind)[part]

    return fixture


llava_dir = _tiny_vlm_part("llava", 0)
hf_llava = _tiny_vlm_part("llava", 1)
gemma3_dir = _tiny_vlm_part("gemma3", 0)
hf_gemma3 = _tiny_vlm_part("gemma3", 1)
