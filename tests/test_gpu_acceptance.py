"""bench/gpu_acceptance.py (`make gpu-check`): on a machine without a GPU it runs the dry run,
writes every GPU section as skipped with its reason and no figures, and its JSON names no path of
the machine; the roofline's bytes per decode step against a hand calculation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.named_configs import NAMED_CONFIGS
from tests.test_bench_results import MACHINE_PREFIXES, strings

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from gpu_roofline import decode_step_bytes, peak_bandwidth_gbps, roofline_tokens_per_s  # noqa: E402

GPU_SECTIONS = ("parity", "kernels", "attention_speed", "decode", "burst")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU machine's report; a GPU measures instead")
def test_without_a_gpu_the_dry_run_passes_and_every_gpu_section_says_why_it_was_skipped(tmp_path: Path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "bench/gpu_acceptance.py", "--out", str(tmp_path),
                           "--dry-run-select", "greedy and 1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    assert (tmp_path / "gpu_acceptance.png").stat().st_size > 0
    sections = results["sections"]
    assert sections["dry_run"]["passed"] is True and sections["dry_run"]["summary"].startswith("1 passed")
    for name in GPU_SECTIONS:
        assert sections[name]["skipped"] == "no CUDA device", name
        assert set(sections[name]) == {"skipped", "not_measured"}, f"{name} holds figures without a device"
        assert f"{name}: skipped (no CUDA device)" in proc.stderr
    assert results["gpu_measured"] is False and results["passed"] is True
    assert results["machine"]["gpu"] is None and results["machine"]["torch"] == torch.__version__
    assert [s for s in strings(results) if s.startswith(MACHINE_PREFIXES)] == []


def test_a_failing_dry_run_fails_the_command(tmp_path: Path):
    """A selection that runs no test is a failure, not a pass with nothing checked."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "bench/gpu_acceptance.py", "--out", str(tmp_path), "--skip", "parity",
                           "--dry-run-select", "no test has this name"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    results = json.loads((tmp_path / "gpu_acceptance.json").read_text())
    assert results["failed"] == ["dry_run"] and results["passed"] is False


def test_bytes_a_llama_3_8b_decode_step_reads_by_hand():
    """Llama-3.1-8B, bf16, 64 jobs of 1024 tokens over an fp16 ("auto") cache."""
    config = ModelConfig.from_dict(NAMED_CONFIGS["llama-3.1-8b"])
    hidden, inter, kv, vocab, layers = 4096, 14336, 8 * 128, 128256, 32
    per_layer = (hidden + 2 * kv) * hidden + hidden * hidden + 3 * hidden * inter + 2 * hidden  # qkv, o, MLP, norms
    weights = 2 * (layers * per_layer + vocab * hidden + hidden)  # + lm_head and the final norm; not the embedding
    assert weights == 15_009_849_344
    kv_per_token = layers * 2 * kv * 2  # K and V, every layer, 2 bytes a value
    step = decode_step_bytes(config, batch=64, context=1024, dtype_bytes=2)
    assert (step.weights, step.kv) == (weights, 64 * 1024 * kv_per_token)
    assert step.total == 23_599_783_936
    # an H100 SXM reads that in 23.6e9 / 3.35e12 s = 7.04 ms: 64 tokens per step, 9085 tokens/s at most
    h100 = peak_bandwidth_gbps("NVIDIA H100 80GB HBM3")
    assert h100 is not None and roofline_tokens_per_s(step, 64, h100) == pytest.approx(9084.8, rel=1e-4)
    # a q8 cache: a byte a value and an fp16 scale per 32 values, 128 + 4 * 2 bytes a vector of 128
    q8 = decode_step_bytes(config, batch=64, context=1024, dtype_bytes=2, cache_dtype="q8")
    assert q8.kv == 64 * 1024 * layers * 2 * 8 * (128 + 8)


def test_peak_bandwidth_by_device_name_and_override():
    assert peak_bandwidth_gbps("NVIDIA H100 PCIe") == 2000.0
    assert peak_bandwidth_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert peak_bandwidth_gbps("NVIDIA H200") == 4800.0
    assert peak_bandwidth_gbps("Some Future GPU") is None
    assert peak_bandwidth_gbps("NVIDIA H100 80GB HBM3", override=3000.0) == 3000.0
