"""The layering (docs/architecture.md): kernels <- engine <- worker -> producer.protocol;
producer never imports engine, kernels, worker or torch; chat_template, the floor below engine
and producer (both render chats with it), imports none of them, nor torch, celery or redis;
image_input, the floor the gateway and the worker decode images with, imports none of ours (and
the protocol, which the base install validates with, imports no Pillow); grammar_limits, the
floor both report llguidance's errors with, imports only llguidance. The development tools
(genq_dev: tiny models, the demo-model fetcher, the perplexity scorer) sit on top of the engine,
outside the service's packages: only the worker commands that make or fetch a model import them."""

from __future__ import annotations

import ast
import site
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "chat_template": {"engine", "kernels", "worker", "producer", "torch", "triton", "celery", "redis"},
    "grammar_limits": {"chat_template", "engine", "kernels", "worker", "producer", "torch", "triton", "celery",
                       "redis"},
    "kernels": {"engine", "worker", "producer"},
    "engine": {"worker", "producer", "celery", "redis"},
    "producer": {"engine", "kernels", "worker", "torch", "triton"},
    # The Batch API's storage and driver see no HTTP: the gateway hands the driver its LineRunner.
    "producer/batches": {"engine", "kernels", "worker", "torch", "triton", "fastapi", "starlette", "celery"},
    "image_input": {"chat_template", "engine", "kernels", "worker", "producer", "genq_dev", "torch", "triton",
                    "celery", "redis"},
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


def imported_modules(path: Path) -> set[str]:
    """Full dotted names of what a file imports; `from a import b` counts as both a and a.b."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


DEVTOOLS = "genq_dev"
DEVTOOLS_USERS = {"worker/cli.py", "worker/dev.py"}
"""`genq make-tiny-model`, `genq demo` and `genq dev`: the commands that make or fetch a model."""


@pytest.mark.parametrize("package", ["chat_template", "image_input", "grammar_limits", "engine", "kernels", "worker",
                                     "producer"])
def test_the_service_never_imports_the_dev_tools(package: str):
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            m for m in imported_modules(path) if m == DEVTOOLS or m.startswith(DEVTOOLS + ".")
        )
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v and k not in DEVTOOLS_USERS} == {}


# The floors below the step see tokens and pages, never text (issue 22): the scheduler, the KV
# manager, the runner and the cache import nothing of the text pipeline, however indirectly.
BELOW_THE_STEP = ("engine.scheduler", "engine.kv_manager", "engine.model_runner", "engine.cache", "engine.sequence")
TEXT_MACHINERY = {"engine.detokenizer", "engine.stops", "engine.banned_strings", "engine.constraints",
                  "engine.tokenizer", "engine.output_processor"}


def engine_closure(module: str) -> set[str]:
    """Every engine module the module imports, directly or through other engine modules."""
    seen: set[str] = set()
    todo = [module]
    while todo:
        name = todo.pop()
        path = ROOT / (name.replace(".", "/") + ".py")
        if name in seen or not path.exists():
            continue
        seen.add(name)
        todo += [m for m in imported_modules(path) if m.startswith("engine.")]
    return seen - {module}


@pytest.mark.parametrize("module", BELOW_THE_STEP)
def test_the_layers_below_the_step_never_reach_the_text_machinery(module: str):
    assert engine_closure(module) & TEXT_MACHINERY == set()


def test_sequence_imports_nothing_but_the_job():
    """And, for its type only, the LoRA adapter a job holds (issue 28), itself a floor of torch alone."""
    engine_imports = {m for m in imported_modules(ROOT / "engine/sequence.py") if m.startswith("engine")}
    assert engine_imports == {"engine.job", "engine.job.Job", "engine.lora.adapter",
                              "engine.lora.adapter.LoraAdapter"}
    assert {m for m in imported_modules(ROOT / "engine/lora/adapter.py") if m.startswith(("engine", "kernels"))} \
        == set()


def test_producer_imports_with_torch_unavailable():
    code = "import sys; sys.modules['torch'] = None; import producer"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_the_protocol_imports_with_pillow_unavailable():
    """The base install (a backend validating requests) has no Pillow: only the gateway and the
    worker decode images (image_input/)."""
    code = ("import sys; sys.modules['PIL'] = None; "
            "import producer.protocol, producer.client, producer.model_card, producer.cli")
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


def test_the_batch_driver_never_imports_the_gateway():
    offenders = {
        str(path.relative_to(ROOT)): sorted(m for m in imported_modules(path) if m.startswith("producer.gateway"))
        for path in (ROOT / "producer" / "batches").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}
