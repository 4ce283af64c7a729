"""The layering in DESIGN.md: kernels <- engine <- worker -> producer.protocol;
producer never imports engine, kernels, worker or torch."""

from __future__ import annotations

import ast
import site
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
        f"assert kernels.__file__.startswith({str(ROOT)!r}); assert not u.is_kernels_available()"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


TORCH_PACKAGES = ("torch", "functorch", "torchgen", "triton", "nvidia")


def test_producer_runs_where_torch_is_not_installed(tmp_path: Path):
    """A real torch-free environment: a site directory holding every installed
    package except torch and its kin, used by an isolated interpreter (-I -S)."""
    site_packages = Path(site.getsitepackages()[0])
    lean = tmp_path / "site-packages"
    lean.mkdir()
    for entry in site_packages.iterdir():
        if not entry.name.lower().startswith(TORCH_PACKAGES):
            (lean / entry.name).symlink_to(entry)
    code = (
        f"import sys; sys.path[:0] = [{str(lean)!r}, {str(ROOT)!r}]\n"
        "import importlib.util; assert importlib.util.find_spec('torch') is None, 'torch is visible'\n"
        "import producer.client, producer.cli, producer.gateway, producer.callbacks\n"
        "import worker.cli; worker.cli.build_parser().parse_args(['submit', 'hello', '--stream'])\n"
        "assert 'torch' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-I", "-S", "-c", code], cwd=tmp_path, check=True)
