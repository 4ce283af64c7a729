"""The layering in DESIGN.md: kernels <- engine <- worker -> producer.protocol;
producer never imports engine, kernels, worker or torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "kernels": {"engine", "worker", "producer"},
    "engine": {"worker", "producer", "celery", "redis"},
    "producer": {"engine", "kernels", "worker", "torch", "triton"},
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_respect_the_layering(package: str):
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_roots(path) & FORBIDDEN[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_producer_imports_with_torch_unavailable():
    code = "import sys; sys.modules['torch'] = None; import producer"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_transformers_does_not_mistake_our_kernels_package_for_its_own():
    """Hugging Face's hub package is also imported as `kernels`; transformers
    must not try to use ours."""
    code = (
        "import kernels, transformers.utils.import_utils as u; "
        "assert kernels.__file__.startswith(%r); assert not u.is_kernels_available()" % str(ROOT)
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
