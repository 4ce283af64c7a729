"""Turns the prefix_and_speculation results dict into the PNG and the markdown tables."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend must be chosen first)
from bench_common import measured_when, number_cell, percentiles_cell, side_by_side, table_lines  # noqa: E402

_DEDUP_LABELS = {"dedup_off": "dedup off", "dedup_on": "dedup on"}
_SPEC_COLORS = ["tab:gray", "tab:blue", "tab:green", "tab:orange", "tab:purple"]


def prefix_table(prefix: dict[str, Any]) -> list[str]:
    w = prefix["workload"]
    rows = []
    for name, label in _DEDUP_LABELS.items():
        run = prefix["best"][name]
        rows.append([label, f"{run['prompt_tokens']:,}", f"{run['computed_prompt_tokens']:,}",
                     f"{run['cached_prompt_tokens']:,}", percentiles_cell(run["ttft_ms"], ("p50", "p90", "max"), 0),
                     f"{run['wall_s']:.2f}"])
    lines = [
        f"**(a) prefix dedup**: {w['num_requests']} requests, {w['system_tokens']}-token shared prefix + "
        f"{w['question_tokens']}-token questions, {w['max_new_tokens']} new tokens each, all enqueued at once",
        "",
        *table_lines(["prefix dedup", "prompt tokens", "computed", "cached", "TTFT p50 / p90 / max (ms)", "wall (s)"],
                     "lrrrrr", rows),
    ]
    match = prefix["outputs_identical"]
    lines += [
        "",
        f"Computed with dedup / without: {prefix['computed_ratio_on_over_off']:.4f} "
        f"(1/{1 / prefix['computed_ratio_on_over_off']:.1f}; target <= 1/8: "
        f"{'met' if prefix['target_met'] else 'NOT met'}); TTFT p50 ratio {prefix['ttft_p50_ratio_on_over_off']:.3f}, "
        f"wall ratio {prefix['wall_ratio_on_over_off']:.3f}; greedy outputs identical "
        f"{match['identical_requests']}/{match['requests']}.",
    ]
    return lines


def speculation_table(spec: dict[str, Any]) -> list[str]:
    w = spec["workload"]
    sel = w["loop_selection"]
    loops = sum(v["looping"] for v in sel["looping_by_pattern_length"].values())
    lines = [
        f"**(b) n-gram speculative decoding**: {w['prompt_tokens']}-token prompts, {w['max_new_tokens']} new tokens, "
        f"greedy; batch 1 = {w['batch1_prompts']} prompts one after another; loop prompts: "
        f"{loops} of {sel['candidates_probed']} probed candidates loop, first {len(sel['kept'])} used",
        "",
    ]
    rows: list[list[object]] = []
    for workload, by_batch in spec["results"].items():
        for batch, cell in by_batch.items():
            for name, row in cell["configs"].items():
                rate = row["acceptance_rate"]
                acceptance = (
                    f"{rate * 100:.1f}% ({row['accepted_draft_tokens']:,} / {row['drafted_tokens']:,})"
                    if rate is not None else ("no drafts" if name != "off" else "-")
                )
                per_verify = number_cell(row.get("mean_accepted_per_verify_step"), 2) if name != "off" else "-"
                draft_len = number_cell(row.get("mean_draft_length"), 2) if name != "off" else "-"
                same = row["outputs_identical_to_off"]
                speedup = f"**{row['speedup']:.2f}x**" if name != "off" else "1.00x"
                rows.append([workload, batch, row["label"], f"{row['generated_tok_s']:.1f}", speedup, acceptance,
                             draft_len, per_verify, f"{row['tokens_per_decode_step']:.2f}",
                             f"{same['identical_requests']}/{same['requests']}"])
    lines += table_lines(["workload", "batch", "configuration", "gen tok/s", "speedup",
                          "acceptance (accepted / drafted)", "draft length per verify step", "accepted per verify step",
                          "tokens per decode step", "outputs = no-spec"], "lrlrrrrrrr", rows)
    s = spec["speedup_batch1_loop"]
    lines += [
        "",
        f"Batch 1, loop workload: n-gram speculation {number_cell(s['num_draft_tokens_4'], 2, 'x')} "
        "with 4 draft tokens "
        f"(best {number_cell(s['best'], 2, 'x')}); target >= {spec['target_speedup_batch1']}x: "
        f"{'met' if spec['target_met'] else 'NOT met'}.",
    ]
    mismatched = [
        f"{workload}/{batch}/{name}"
        for workload, by_batch in spec["results"].items()
        for batch, cell in by_batch.items()
        for name, row in cell["configs"].items()
        if row.get("engine_matches_replay") is False
    ]
    if mismatched:
        lines.append(f"Engine draft counts differ from the replay of its drafting rule in: {', '.join(mismatched)}.")
    return lines


def markdown_table(results: dict[str, Any]) -> str:
    lines: list[str] = []
    if "prefix" in results:
        lines += prefix_table(results["prefix"]) + [""]
    if "speculation" in results:
        lines += speculation_table(results["speculation"]) + [""]
    machine, settings = results["machine"], results["settings"]
    lines.append(
        f"{settings['model']} llama ({settings['parameters'] / 1e6:.1f}M parameters), fp32; {machine['cpu_model']}, "
        f"torch threads: {machine['torch_threads']}, torch {machine['torch']}; best of {settings['repeats']} "
        f"repetition(s); {measured_when(machine)}."
    )
    return "\n".join(lines)


def _plot_prefix(ax: plt.Axes, prefix: dict[str, Any]) -> None:
    names = ["dedup_off", "dedup_on"]
    runs = [prefix["best"][n] for n in names]
    xs = range(len(names))
    computed = [r["computed_prompt_tokens"] for r in runs]
    bars = ax.bar([x - 0.2 for x in xs], computed, 0.4, color="tab:blue", label="prompt tokens computed")
    ax.bar_label(bars, labels=[f"{c:,}" for c in computed], fontsize=8)
    ax.set_ylabel("prompt tokens computed")
    ax.set_xticks(list(xs), [_DEDUP_LABELS[n] for n in names])
    twin = ax.twinx()
    p50 = [r["ttft_ms"]["p50"] for r in runs]
    bars = twin.bar([x + 0.2 for x in xs], p50, 0.4, color="tab:orange", label="TTFT p50 (ms)")
    twin.bar_label(bars, fmt="%.0f", fontsize=8)
    twin.scatter([x + 0.2 for x in xs], [r["ttft_ms"]["p90"] for r in runs], marker="^", color="black", s=20,
                 zorder=3, label="TTFT p90")
    twin.scatter([x + 0.2 for x in xs], [r["ttft_ms"]["max"] for r in runs], marker="x", color="black", s=20,
                 zorder=3, label="TTFT max")
    twin.set_ylabel("time to first token (ms)")
    handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], fontsize=8, loc="upper center",
              bbox_to_anchor=(0.5, -0.08), ncol=4)
    ax.set_ylim(0, max(computed) * 1.12)
    twin.set_ylim(0, max(r["ttft_ms"]["max"] for r in runs) * 1.12)
    w = prefix["workload"]
    ax.set_title(
        f"(a) {w['num_requests']} requests sharing a {w['system_tokens']}-token prefix: "
        f"computed x{prefix['computed_ratio_on_over_off']:.3f}",
        fontsize=10,
    )


def _plot_speculation(ax: plt.Axes, spec: dict[str, Any]) -> None:
    groups = [(wl, b) for wl, by_batch in spec["results"].items() for b in by_batch]
    names: list[str] = []
    labels: dict[str, str] = {}
    for wl, b in groups:
        for name, row in spec["results"][wl][b]["configs"].items():
            if name not in names:
                names.append(name)
                labels[name] = row["label"]
    for k, name in enumerate(names):
        positions, width = side_by_side(len(groups), len(names), k)
        xs, ys, notes = [], [], []
        for i, (wl, b) in enumerate(groups):
            row = spec["results"][wl][b]["configs"].get(name)
            if row is None:
                continue
            xs.append(positions[i])
            ys.append(row["generated_tok_s"])
            rate = row["acceptance_rate"]
            notes.append(f"{row['speedup']:.2f}x" + (f"\n{rate * 100:.0f}%" if rate is not None else ""))
        bars = ax.bar(xs, ys, width, label=labels[name], color=_SPEC_COLORS[k % len(_SPEC_COLORS)])
        ax.bar_label(bars, labels=notes, fontsize=7)
    ax.set_xticks(range(len(groups)), [f"{wl} prompts, batch {b}" for wl, b in groups], fontsize=8)
    ax.set_ylabel("generated tokens/s")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.12)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2)
    ax.set_title("(b) n-gram speculation: tokens/s (labels: speedup, acceptance rate)", fontsize=10)


def plot(results: dict[str, Any], path: Path) -> None:
    panels = [p for p in ("prefix", "speculation") if p in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), 5.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        (_plot_prefix if panel == "prefix" else _plot_speculation)(ax, results[panel])
    machine, settings = results["machine"], results["settings"]
    fig.suptitle(
        f"{settings['model']} llama, greedy, fp32 - {machine['cpu_model']}, "
        f"torch threads: {machine['torch_threads']} - "
        f"{machine['date']}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.subplots_adjust(bottom=0.22)
    fig.savefig(path, dpi=120)
    plt.close(fig)
