"""Every Triton kernel against its torch reference in Triton's interpreter on
CPU, the dispatch rule of kernels/__init__.py, and the whole engine's greedy
output with the Triton path forced.

TRITON_INTERPRET must be set before triton is imported, and other test
modules may already have imported torch (and so, possibly, triton) in this
process; each check group therefore runs in a fresh interpreter process
(tests/kernel_checks.py), which prints one line per case with its max abs
error. Tolerances: 1e-5 for fp32, 2e-2 for bf16.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "tests" / "kernel_checks.py"


def run_python(args: list[str], env_extra: dict[str, str], timeout: float = 300) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GENQ_FORCE_TRITON")}
    env.update(env_extra)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    return proc.stdout


@pytest.mark.parametrize(
    "group",
    ["rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "apply_rope", "write_kv", "attention_decode",
     "attention_prefill", "lora", "lora_engine"],
)
def test_triton_kernel_matches_reference_in_interpreter(group: str):
    out = run_python([str(CHECKS), group], {"TRITON_INTERPRET": "1"})
    assert out.strip(), "no cases ran"


def test_engine_greedy_output_identical_with_triton_forced():
    """llama and qwen3 tiny models and a Gemma 2 one; a batch with prefill chunks,
    decodes, mixed steps and a prefix-cache hit (kernel_checks.check_engine asserts each)."""
    out = run_python([str(CHECKS), "engine"], {"TRITON_INTERPRET": "1"})
    assert out.count("engine ") == 3


def test_cpu_tensors_take_the_reference_path_without_importing_the_triton_kernels():
    """(torch imports triton itself on the first custom operator call, with torch._dynamo.)"""
    code = (
        "import sys, torch, kernels\n"
        "x = torch.randn(3, 8)\n"
        "out, _ = kernels.rms_norm(x, torch.ones(8), 1e-6)\n"
        "assert not kernels.triton_enabled(x)\n"
        "assert 'kernels.triton_kernels' not in sys.modules\n"
    )
    run_python(["-c", code], {})


def test_kernels_import_without_triton_and_fail_loudly_only_when_forced():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import os, torch, kernels\n"
        "x = torch.randn(2, 2 * 8)\n"
        "assert kernels.silu_and_mul(x).shape == (2, 8)\n"
        "os.environ['GENQ_FORCE_TRITON'] = '1'\n"
        "try:\n"
        "    kernels.silu_and_mul(x)\n"
        "except ImportError as exc:\n"
        "    assert 'triton' in str(exc), exc\n"
        "else:\n"
        "    raise AssertionError('the forced Triton path ran without triton')\n"
    )
    run_python(["-c", code], {})


def test_forcing_triton_on_cpu_selects_the_interpreter_through_the_public_api():
    """GENQ_FORCE_TRITON=1 alone: the dispatcher turns the interpreter on
    (triton not yet imported) and the public functions run the Triton kernels."""
    code = (
        "import sys, torch, kernels\n"
        "from kernels import reference\n"
        "x = torch.randn(4, 2 * 16)\n"
        "assert kernels.triton_enabled(x)\n"
        "got = kernels.silu_and_mul(x)\n"
        "assert 'kernels.triton_kernels' in sys.modules\n"
        "assert (got - reference.silu_and_mul(x)).abs().max() <= 1e-5\n"
    )
    run_python(["-c", code], {"GENQ_FORCE_TRITON": "1"})


def test_triton_kernels_compile_for_an_sm90_gpu_without_one():
    """The interpreter runs kernels as numpy; this catches what only Triton's
    compiler rejects, by compiling every kernel (bf16) to an H100 cubin."""
    out = run_python([str(ROOT / "tests" / "kernel_compile_check.py"), "bf16"], {})
    assert out.count("compiled for sm_90") == 12
