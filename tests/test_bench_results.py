"""Benchmark results name the machine but hold none of its absolute paths (bench/bench_common.results_json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from bench_common import REPO_ROOT, results_json  # noqa: E402

MACHINE_PREFIXES = ("/home/", "/root/", "/tmp/", "/work/", "/Users/", str(ROOT))


def strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for item in value.values() for s in strings(item)]
    if isinstance(value, list):
        return [s for item in value for s in strings(item)]
    return [value] if isinstance(value, str) else []


def test_results_json_writes_paths_inside_the_repository_relative_to_it():
    results = {"model": {"path": f"{REPO_ROOT}/bench/.models/llama-tiny-seed0"}, "runs": [f"{REPO_ROOT}/x.gguf"],
               "endpoint": "/v1/completions"}
    assert json.loads(results_json(results)) == {"model": {"path": "bench/.models/llama-tiny-seed0"},
                                                 "runs": ["x.gguf"], "endpoint": "/v1/completions"}


def test_no_committed_result_holds_an_absolute_path_of_the_machine_that_made_it():
    offenders = {str(path.relative_to(ROOT)): [s for s in strings(json.loads(path.read_text()))
                                                if s.startswith(MACHINE_PREFIXES)]
                 for path in (ROOT / "bench" / "results").glob("*.json")}
    assert {name: found for name, found in offenders.items() if found} == {}
