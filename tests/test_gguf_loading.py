"""GGUF files as checkpoints: dequantization against the `gguf` package's own
numpy dequantizer, whole models against transformers' GGUF loader and against
the HF directory they were written from, and bad files refused by name."""

from __future__ import annotations

import io
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFWriter, quants
from safetensors.numpy import load_file
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from engine import Generator
from engine.errors import ModelLoadError, UnsupportedArchitectureError
from engine.gguf_dequant import dequantize
from engine.gguf_file import GGUFFile
from engine.progress import LoadProgress
from engine.weights import load_model
from tests.conftest import FAMILIES
from tests.engine_runs import greedy_completions
from tests.gguf_files import K_QUANTS, encode_tensor, finish, gguf_name, write_gguf
from tests.test_engine_vs_transformers import hf_greedy

QUANT_TYPES = (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, *K_QUANTS)
# Row lengths a multiple of 256, as the K-quants need.
WIDE = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2}


@pytest.fixture(scope="session")
def gguf_source(tiny_model_factory: Callable[..., Path]) -> Callable[..., Path]:
    """Tiny HF models a GGUF can represent: llama.cpp metadata has no llama3 rope_scaling block."""
    return lambda family, **options: tiny_model_factory(family, rope_scaling=None, **options)


@pytest.mark.parametrize("kind", QUANT_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_the_gguf_package(kind: Q):
    rng = np.random.default_rng(int(kind))
    values = rng.standard_normal((6, 512)).astype(np.float32)
    raw = encode_tensor(values, kind, rng)
    expected = quants.dequantize(raw, kind)
    got = dequantize(raw, kind, values.shape, torch.float32).numpy()
    assert got.shape == expected.shape == values.shape
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
    if kind not in K_QUANTS:  # real quantization: the values survive, roughly
        assert np.abs(got - values).max() < 0.5 * np.abs(values).max()


@pytest.mark.parametrize("kind", QUANT_TYPES, ids=lambda q: q.name)
def test_loaded_weights_equal_independent_dequantization(kind: Q, gguf_source: Callable[..., Path],
                                                         tmp_path: Path):
    """Every weight matrix stored as `kind`: the model loaded from the .gguf equals the HF
    directory holding the gguf package's dequantization of the same bytes."""
    source = gguf_source("qwen3", **WIDE)
    file = write_gguf(source, tmp_path / "model.gguf", types=lambda name: kind)
    reference_dir = shutil.copytree(source, tmp_path / "reference")
    reader = GGUFReader(file)
    hf_names = {gguf: hf for hf, gguf in _hf_to_gguf(source).items()}
    reference = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)
        reference[hf_names[tensor.name]] = torch.from_numpy(np.array(values))
    save_file(reference, str(reference_dir / "model.safetensors"))
    assert {t.tensor_type for t in reader.tensors if len(t.shape) == 2} == {kind}
    loaded, expected = load_model(file).state_dict(), load_model(reference_dir).state_dict()
    assert loaded.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(loaded[name], value, rtol=1e-6, atol=0, msg=name)


def _hf_to_gguf(model_dir: Path) -> dict[str, str]:
    names = load_file(str(model_dir / "model.safetensors"))
    return {name: gguf_name(name) for name in names if name != "lm_head.weight"}


@pytest.mark.parametrize(("family", "kind"), [*((f, Q.F32) for f in FAMILIES), ("llama", Q.Q8_0)],
                         ids=[*FAMILIES, "llama-Q8_0"])
def test_greedy_matches_transformers_on_the_same_gguf(family: str, kind: Q, gguf_source: Callable[..., Path],
                                                      tmp_path: Path):
    # transformers reads no head_dim from a qwen3 GGUF (it ignores attention.key_length) and
    # falls back to Qwen3Config's 128, so the reference is only right for that head size.
    source = gguf_source(family, **({"head_dim": 128} if family == "qwen3" else {}))
    file = write_gguf(source, tmp_path / f"{family}.gguf", types=lambda name: kind)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=file.name, dtype=torch.float32).eval()
    generator = Generator.from_pretrained(file, cache_tokens=2048, page_size=8)
    rng = random.Random(family)
    vocab = generator.model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 7, 9, 23, 40)]
    engine = greedy_completions(generator, prompts, 10)
    assert engine == [hf_greedy(hf, p, 10) for p in prompts]
    if kind == Q.F32:  # lossless: the same tokens as the HF directory the file was written from
        plain = Generator.from_pretrained(source, cache_tokens=2048, page_size=8)
        assert engine == greedy_completions(plain, prompts, 10)


def test_a_mistral_architecture_file_gives_the_tokens_of_its_hf_directory(gguf_source: Callable[..., Path],
                                                                            tmp_path: Path):
    """llama.cpp writes Mistral models as `mistral` too (Q/K rows interleaved as for `llama`)."""
    source = gguf_source("mistral")
    file = write_gguf(source, tmp_path / "mistral.gguf", architecture="mistral")
    generator = Generator.from_pretrained(file, cache_tokens=2048, page_size=8)
    assert generator.model.config.family == "mistral"
    rng = random.Random("mistral")
    prompts = [[rng.randrange(generator.model.config.vocab_size) for _ in range(n)] for n in (1, 9, 30)]
    expected = greedy_completions(Generator.from_pretrained(source, cache_tokens=2048, page_size=8), prompts, 10)
    assert greedy_completions(generator, prompts, 10) == expected


# -- bad files -------------------------------------------------------------


def test_truncated_file_is_named(gguf_source: Callable[..., Path], tmp_path: Path):
    file = write_gguf(gguf_source("llama"), tmp_path / "whole.gguf")
    data = file.read_bytes()
    for name, size in (("header", 100), ("tensors", len(data) - 1000)):
        cut = tmp_path / f"cut-{name}.gguf"
        cut.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            load_model(cut)


def test_not_a_gguf_file_is_named(tmp_path: Path):
    file = tmp_path / "model.gguf"
    file.write_bytes(b"PK\x03\x04 a zip, not a model")
    with pytest.raises(ModelLoadError, match="is not a GGUF file"):
        load_model(file)


def test_unknown_architecture_is_named(tmp_path: Path):
    file = tmp_path / "phi2.gguf"
    writer = GGUFWriter(str(file), "phi2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    finish(writer)
    with pytest.raises(UnsupportedArchitectureError, match="architecture 'phi2' is not supported.*llama"):
        load_model(file)


def test_unknown_quant_type_id_is_named(gguf_source: Callable[..., Path], tmp_path: Path):
    file = write_gguf(gguf_source("llama"), tmp_path / "model.gguf")
    data = bytearray(file.read_bytes())
    name = b"blk.0.ffn_down.weight"
    at = data.index(name) + len(name)
    dims = int.from_bytes(data[at : at + 4], "little")
    type_at = at + 4 + 8 * dims
    data[type_at : type_at + 4] = (99).to_bytes(4, "little")
    file.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match="unknown ggml quantization type.*99"):
        load_model(file)


def test_unsupported_quant_type_is_named(gguf_source: Callable[..., Path], tmp_path: Path):
    source = gguf_source("qwen2")
    file = tmp_path / "iq4.gguf"
    writer_file = write_gguf(source, tmp_path / "plain.gguf")
    reader = GGUFReader(writer_file)
    writer = GGUFWriter(str(file), "qwen2")
    for key, field in reader.fields.items():
        if key.startswith(("qwen2.", "tokenizer.ggml.bos", "tokenizer.ggml.eos")):
            writer.add_key_value(key, field.contents(), field.types[0],
                                 field.types[-1] if len(field.types) > 1 else None)
    for tensor in reader.tensors:
        if tensor.name == "blk.0.ffn_up.weight":
            rows, cols = tensor.data.shape
            writer.add_tensor(tensor.name, np.zeros((rows, cols // 32 * 18), dtype=np.uint8), raw_dtype=Q.IQ4_NL)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data))
    finish(writer)
    with pytest.raises(ModelLoadError, match="'blk.0.ffn_up.weight' is stored as IQ4_NL, which is not supported"):
        load_model(file)


def test_missing_tensor_is_named(gguf_source: Callable[..., Path], tmp_path: Path):
    file = write_gguf(gguf_source("llama"), tmp_path / "model.gguf", drop=frozenset({"blk.1.ffn_up.weight"}))
    with pytest.raises(ModelLoadError, match=r"lacks 1 tensors: model.layers.1.mlp.up_proj.weight"):
        load_model(file)


def test_missing_metadata_is_named(tmp_path: Path):
    file = tmp_path / "bare.gguf"
    writer = GGUFWriter(str(file), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    finish(writer)
    with pytest.raises(ModelLoadError, match="metadata key 'llama.embedding_length' is missing"):
        GGUFFile(file).config_dict()


def test_progress_counts_tensors(gguf_source: Callable[..., Path], tmp_path: Path):
    file = write_gguf(gguf_source("llama"), tmp_path / "model.gguf")
    calls: list[tuple[int, int]] = []
    load_model(file, progress=lambda done, total: calls.append((done, total)))
    total = len(GGUFReader(file).tensors)
    assert calls == [(i, total) for i in range(1, total + 1)]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_loading_progress_is_a_bar_on_a_terminal_and_a_line_per_tenth_in_a_log(
    gguf_source: Callable[..., Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    file = write_gguf(gguf_source("llama"), tmp_path / "model.gguf")
    total = len(GGUFReader(file).tensors)
    terminal = _Terminal()
    load_model(file, progress=LoadProgress(stream=terminal))
    frames = terminal.getvalue().split("\r")[1:]
    assert len(frames) == total and frames[-1].startswith("loading weights [" + "#" * 30 + f"] {total}/{total} 100%")
    assert frames[-1].endswith("\n") and not any(frame.endswith("\n") for frame in frames[:-1])
    with caplog.at_level(logging.INFO, logger="engine.loading"):
        load_model(file, progress=LoadProgress(stream=io.StringIO()))
    lines = [record.getMessage() for record in caplog.records]
    assert 2 <= len(lines) <= 11 and lines[-1].startswith(f"loading weights: {total}/{total} (100%")
