"""How issue 22's reshape changed the product lines (engine/, worker/, producer/, kernels/), from git.

The reshape landed in commit 500194c together with issues 23-27's features (recovered from a failed
stop), so no single diff shows it. This prints what can be separated (docs/architecture.md, "How the
reshape is measured"): the product lines at each revision; the lines that commits after 500194c
added and removed in those folders, by the issues their messages name; the size of the files
the issue names, before the reshape and now, each beside what replaced it; and, by git blame, which
of today's code lines in those files later features wrote, so that the concerns can be compared
with the features that landed in them since taken out.

Run from the repository root: `python bench/product_lines.py` (it reads the history only).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
from collections.abc import Sequence

PRODUCT = ("engine/", "worker/", "producer/", "kernels/")
RECOVERY = "500194c"
"""The commit that landed issues 22-27 at once."""

GROUPS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # name: (the files before the reshape, the files that hold the same concerns now)
    "the step (Generator)": (
        ("engine/generator.py", "engine/speculative.py"),
        ("engine/generator.py", "engine/admission.py", "engine/loading.py", "engine/output_processor.py",
         "engine/spec_decode.py", "engine/step_batch.py", "engine/engine_config.py", "engine/stats.py")),
    "sampling": (
        ("engine/sampling.py", "engine/batch_sampler.py", "engine/slot_extras.py"),
        ("engine/sampling.py", "engine/sampler_settings.py", "engine/sampling_state.py", "engine/batch_sampler.py",
         "engine/slot_extras.py")),
    "Sequence": (("engine/sequence.py",), ("engine/sequence.py",)),
    "worker loop, events, tasks": (
        ("worker/loop.py", "worker/tasks.py", "worker/jobs.py", "worker/redelivery.py"),
        ("worker/loop.py", "worker/events.py", "worker/control.py", "worker/delivery.py", "worker/tasks.py",
         "worker/jobs.py", "worker/redelivery.py")),
    "worker knobs (Settings, CLI, Runtime)": (
        ("worker/settings.py", "worker/cli.py", "worker/runtime.py"),
        ("worker/settings.py", "worker/settings_cli.py", "worker/cli.py", "worker/runtime.py")),
    "dev tools (moved to genq_dev/)": (("engine/tiny_model.py", "engine/real_model.py", "engine/perplexity.py"), ()),
}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def lines_at(revision: str, paths: Sequence[str]) -> int:
    """Lines (newlines, as `wc -l` counts them) of these files at `revision`; a missing file counts 0."""
    present = set(git("ls-tree", "-r", "--name-only", revision, "--", *paths).split()) if paths else set()
    return sum(git("show", f"{revision}:{path}").count("\n") for path in present)


def code_line_numbers(text: str) -> set[int]:
    """The 1-based numbers of the lines that are neither blank, nor imports, nor docstrings: what a
    split into smaller files does not add by itself (each new file brings its imports and docstring)."""
    overhead = {number for number, line in enumerate(text.splitlines(), 1) if not line.strip()}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import | ast.ImportFrom) or (
                isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)):
            overhead.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return set(range(1, text.count("\n") + 1)) - overhead


def code_lines_at(revision: str, paths: Sequence[str]) -> int:
    """Code lines (code_line_numbers) of these files at `revision`; a missing file counts 0."""
    present = set(git("ls-tree", "-r", "--name-only", revision, "--", *paths).split()) if paths else set()
    return sum(len(code_line_numbers(git("show", f"{revision}:{path}"))) for path in present)


def code_lines_by_origin(head: str, paths: Sequence[str]) -> dict[str, int]:
    """The code lines of these files at `head`, by the commit that last wrote each (git blame):
    before RECOVERY, RECOVERY itself, later commits naming issue 22, and later commits that do not."""
    present = set(git("ls-tree", "-r", "--name-only", head, "--", *paths).split()) if paths else set()
    recovery = git("rev-parse", RECOVERY).strip()
    later = set(git("rev-list", f"{RECOVERY}..{head}").split())
    origins: dict[str, int] = {"before": 0, "recovery": 0, "issue 22": 0, "features": 0}
    origin_of: dict[str, str] = {}  # commit -> its origin, read once per commit
    for path in present:
        code = code_line_numbers(git("show", f"{head}:{path}"))
        for line in git("blame", "--porcelain", head, "--", path).splitlines():
            fields = line.split()
            if len(fields) >= 3 and len(fields[0]) == 40 and fields[2].isdigit() and int(fields[2]) in code:
                commit = fields[0]
                if commit not in origin_of:
                    origin_of[commit] = (
                        "recovery" if commit == recovery else "before" if commit not in later
                        else "issue 22" if 22 in issues_named(git("log", "-1", "--format=%B", commit))
                        else "features")
                origins[origin_of[commit]] += 1
    return origins


def product_files(revision: str) -> list[str]:
    return git("ls-tree", "-r", "--name-only", revision, "--", *PRODUCT).split()


def issues_named(message: str) -> set[int]:
    """The issue numbers a commit message names: "issue 22", "issues 22, 30", "issues 22-27"."""
    named: set[int] = set()
    for match in re.finditer(r"\bissues?\s+(\d+(?:\s*(?:-|,|and)\s*\d+)*)", message, re.IGNORECASE):
        for part in re.split(r"\s*(?:,|and)\s*", match.group(1)):
            first, _, last = part.partition("-")
            named.update(range(int(first), int(last or first) + 1))
    return named


def churn_by_kind(since: str, head: str) -> dict[str, dict[str, list[int]]]:
    """Lines added and removed per product file by the commits since `since` (merges left out: their
    branches' commits count; a move out of the folders is a removal), summed by whether the commit
    names issue 22 alone, issue 22 among others, or not issue 22: {kind: {path: [added, removed]}},
    with the commit count under the path ""."""
    sums: dict[str, dict[str, list[int]]] = {}
    for commit in git("rev-list", "--no-merges", f"{since}..{head}").split():
        named = issues_named(git("log", "-1", "--format=%B", commit))
        kind = sums.setdefault("issue 22 alone" if named == {22} else "issue 22 and others" if 22 in named
                               else "not issue 22", {"": [0, 0]})
        kind[""][0] += 1
        for line in git("show", "--no-renames", "--numstat", "--format=", commit, "--", *PRODUCT).splitlines():
            plus, minus, path = line.split("\t", 2)
            if plus != "-":  # not a binary file
                row = kind.setdefault(path, [0, 0])
                row[0], row[1] = row[0] + int(plus), row[1] + int(minus)
    return sums


def net(churn: dict[str, list[int]], paths: Sequence[str]) -> int:
    return sum(churn[p][0] - churn[p][1] for p in paths if p in churn)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", default="HEAD", help="the revision to measure (default HEAD)")
    head = parser.parse_args(argv).head
    before = f"{RECOVERY}^"
    print("| revision | product lines |\n|---|---:|")
    for revision in (before, RECOVERY, head):
        print(f"| {revision} | {lines_at(revision, product_files(revision)):,} |")
    churn = churn_by_kind(RECOVERY, head)
    print(f"\n| commits after {RECOVERY} | commits | added | removed | net |\n|---|---:|---:|---:|---:|")
    for kind, files in sorted(churn.items()):
        added, removed = (sum(row[i] for path, row in files.items() if path) for i in (0, 1))
        print(f"| {kind} | {files[''][0]} | {added:,} | {removed:,} | {added - removed:+,} |")
    later = churn.get("not issue 22", {})
    print(f"\n| concern | files before → now | lines at {before} → {head} | code lines | lines added after {RECOVERY} "
          f"by commits not naming issue 22 |\n|---|---:|---:|---:|---:|")
    for name, (old, new) in GROUPS.items():
        print(f"| {name} | {len(old)} → {len(new)} | {lines_at(before, old):,} → {lines_at(head, new):,} | "
              f"{code_lines_at(before, old):,} → {code_lines_at(head, new):,} | {net(later, new):+,} |")
    print(f"\n| concern | code lines at {before} | code lines at {head}, last written: before {RECOVERY} "
          f"| in {RECOVERY} | by issue 22 after | by features after | {head} less features after |"
          "\n|---|---:|---:|---:|---:|---:|---:|")
    totals = dict.fromkeys(("old", "before", "recovery", "issue 22", "features", "kept"), 0)
    for name, (old, new) in GROUPS.items():
        origins = code_lines_by_origin(head, new)
        row = {"old": code_lines_at(before, old), **origins, "kept": sum(origins.values()) - origins["features"]}
        totals = {key: totals[key] + row[key] for key in totals}
        print(f"| {name} | " + " | ".join(f"{row[key]:,}" for key in totals) + " |")
    print("| all of them | " + " | ".join(f"{totals[key]:,}" for key in totals) + " |")


if __name__ == "__main__":
    main()
