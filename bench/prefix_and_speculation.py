"""Prefix dedup and n-gram speculative decoding: what each saves, on the same model.

(a) Prefix dedup. N requests (64; 16 with --quick) share one system prompt of S
    tokens (1,024; 512 with --quick: random non-special token ids, fixed seed),
    each followed by its own Q-token question (32), max_new_tokens 16 (8 with
    --quick), greedy, EOS ignored, all enqueued at once. The same workload runs on
    a fresh Generator with prefix_caching=True and with prefix_caching=False: same
    model, same KV cache (enough pages for every request at full length without
    any sharing), page size 16, max_chunk_size 2048, max_batch_size N.
    Reported: prompt tokens computed (stats.computed_prompt_tokens) for both runs
    and their ratio (target: dedup-on computes at most 1/8 of dedup-off), prompt
    tokens served from the cache (stats.cached_prompt_tokens and the eos results'
    cached_tokens), time to first token p50/p90/max (from the moment just before
    the first enqueue to when iterate() returns the job's first token), wall time,
    and whether the greedy outputs are identical between the two runs.

(b) Speculative decoding (n-gram / prompt-lookup drafts) at batch 1 and batch 16,
    greedy, EOS ignored, 256 new tokens (48 with --quick), prompts of 128 tokens.
    Workloads:
      loop    prompts the tiny random model continues by looping. Random-weight
              models do not loop on random prompts (their greedy continuation of a
              random prompt has ~300 distinct tokens in 384 and n-gram drafts are
              accepted ~1% of the time), but some prompts made of a short random
              pattern repeated (period 1, 2 or 4, cycled) lock them into a loop.
              Candidates, in a fixed seeded order, are probed in batches with 64
              greedy tokens (speculation off); a candidate is kept when the last
              32 probe tokens repeat with a period of at most 8. The first 16 kept
              form the workload (batch 16; batch 1 runs the first 4 of them, one
              after another). The probe looks at 64 tokens only; the acceptance
              rate over the 256 measured tokens is measured, not selected.
      random  control: random 128-token prompts, no selection (drafts rarely match,
              so this shows what speculation costs when it does not pay).
    Configurations: no speculation; use_ngram_draft with num_draft_tokens 4 and 8
    (max_ngram 4, max_speculative_batch 64 so that batch 16 still speculates); at
    batch 16 also num_draft_tokens 4 with the default max_speculative_batch (8), to
    show speculation switching itself off for a batch that large. The random
    control runs without speculation and with 4 draft tokens only.
    Reported: generated tokens/s (all generated tokens / wall time; for batch 1
    the walls of the sequential runs are summed), speedup over no speculation,
    acceptance rate (accepted / drafted draft tokens, from stats), mean accepted
    draft tokens per verify step (a verify step = a decode step of one job that
    carried a draft), tokens per decode step per job, and whether the outputs
    equal the no-speculation run's (greedy must be exact). Verify steps come from
    replaying the engine's drafting rule (engine.spec_decode.ngram_draft, cut to
    min(num_draft_tokens, max_new_tokens - generated - 1)) over the
    no-speculation output; the replay's drafted/accepted totals are checked
    against the engine's stats, which cross-checks the engine's bookkeeping.
    Target: at batch 1 on the loop workload, >= 1.5x tokens/s.

Timing: fp32 on CPU, --threads torch threads (default 1: the results are
ratios, and on a shared machine a team of 2 OpenMP threads stalls whenever a
neighbour takes a core, which made 2-thread runs vary 3x from step to step).
Every run uses a fresh Generator over the same loaded model and KV
cache (so no prefix-cache state leaks between runs), after a warm-up of every
code path. Each configuration runs --repeats times (2 full, 1 quick), the
configurations interleaved so a busy neighbour hits all alike; the fastest
repetition is the headline (a neighbour can only slow a run down); every
repetition's wall time is in the JSON.

Writes <out>/prefix_and_speculation.json and .png (prefix_and_speculation_quick.*
with --quick), prints markdown tables; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench_common import (
    available_cores,
    bench_parser,
    ensure_model,
    percentiles_ms,
    progress,
    start_run,
    write_results,
)
from engine_throughput import compare_tokens
from prefix_spec_report import markdown_table, plot

from engine import Generator, Job
from engine.engine_config import SpeculativeConfig
from engine.spec_decode import ngram_draft
from genq_dev.tiny_model import PRESETS, count_parameters

PARTS = ("prefix", "speculation")
DEDUP_TARGET_RATIO = 1 / 8
SPEEDUP_TARGET = 1.5


@dataclass(frozen=True)
class PrefixSpec:
    num_requests: int = 64
    system_tokens: int = 1024
    question_tokens: int = 32
    max_new_tokens: int = 16


@dataclass(frozen=True)
class SpecSpec:
    prompt_tokens: int = 128
    max_new_tokens: int = 256
    batch_sizes: tuple[int, ...] = (1, 16)
    batch1_prompts: int = 4
    draft_lengths: tuple[int, ...] = (4, 8)
    probe_tokens: int = 64
    probe_tail: int = 32
    max_loop_period: int = 8
    probe_batch: int = 48
    max_candidates: int = 960
    patterns: tuple[int, ...] = (1, 2, 4)


FULL_PREFIX = PrefixSpec()
QUICK_PREFIX = PrefixSpec(num_requests=16, system_tokens=512, question_tokens=32, max_new_tokens=8)
FULL_SPEC = SpecSpec()
QUICK_SPEC = SpecSpec(max_new_tokens=48, batch1_prompts=2, draft_lengths=(4,))
SPECULATIVE_BATCH = 64  # max_speculative_batch for the rows that must speculate at batch 16
DEFAULT_SPECULATIVE_BATCH = 8  # the engine's default (SpeculativeConfig), checked in main()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(
        __doc__,
        quick="smoke run: (a) 16 requests, 512-token shared prefix, 8 new tokens; (b) 48 new tokens, batch 1 on "
              "2 prompts, num_draft_tokens 4 only; 1 repetition; writes prefix_and_speculation_quick.{json,png}",
        epilog="The full run takes a few minutes on 2 CPU cores; --quick is a smoke check (~1 minute).",
    )
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    parser.add_argument("--model", default="tiny", choices=list(PRESETS), help="llama preset (default tiny)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workloads' token ids (default 0)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repetitions per configuration (2; 1 quick)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help=f"torch threads (default 1, see above; this machine offers {available_cores()})",
    )
    parser.add_argument("--page-size", type=int, default=16, help="KV page size (default 16)")
    parser.add_argument("--chunk-size", type=int, default=2048, help="max_chunk_size, tokens per step (default 2048)")
    args = parser.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in PARTS for p in parts):
        parser.error(f"--parts: expected a comma-separated subset of {','.join(PARTS)}, got {args.parts!r}")
    args.parts = parts
    if args.repeats is None:
        args.repeats = 1 if args.quick else 2
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    return args


# -- running jobs ---------------------------------------------------------------


@dataclass
class RunTrace:
    """One batch of jobs on one Generator. Times are time.perf_counter() seconds;
    all jobs are enqueued right after `start`."""

    start: float
    end: float
    tokens: list[list[int]]
    token_times: list[list[float]]
    token_steps: list[int]  # per job: iterate() calls that returned tokens for it
    eos: list[dict[str, Any]]
    stats: dict[str, int] = field(default_factory=dict)  # GeneratorStats counters, after - before

    @property
    def wall(self) -> float:
        return self.end - self.start


STAT_COUNTERS = (
    "steps", "generated_tokens", "computed_prompt_tokens", "cached_prompt_tokens", "preemptions",
    "drafted_tokens", "accepted_draft_tokens",
)


def run_jobs(gen: Generator, prompts: Sequence[list[int]], max_new_tokens: int) -> RunTrace:
    """Enqueue every prompt (greedy, EOS ignored), then iterate() until all are
    done; a token's time is when the iterate() call that produced it returns."""
    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    times: list[list[float]] = [[] for _ in range(n)]
    steps = [0] * n
    eos: list[dict[str, Any]] = [{} for _ in range(n)]
    before = gen.stats
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        gen.enqueue(Job(prompt, max_new_tokens, stop_conditions=[], identifier=i))
    while gen.num_remaining_jobs():
        results = gen.iterate()
        now = time.perf_counter()
        for result in results:
            i = result["identifier"]
            if result["stage"] in ("streaming", "eos") and result["token_ids"]:
                tokens[i].extend(result["token_ids"])
                times[i].extend([now] * len(result["token_ids"]))
                steps[i] += 1
            if result["eos"]:
                eos[i] = {
                    k: result.get(k)
                    for k in ("eos_reason", "new_tokens", "prompt_tokens", "cached_tokens",
                              "accepted_draft_tokens", "rejected_draft_tokens")
                }
    end = time.perf_counter()
    after = gen.stats
    counters = {k: getattr(after, k) - getattr(before, k) for k in STAT_COUNTERS}
    return RunTrace(start, end, tokens, times, steps, eos, counters)


def non_special_ids(gen: Generator) -> list[int]:
    special = gen.tokenizer.special_token_ids
    return [t for t in range(gen.model.config.vocab_size) if t not in special]


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def fresh(base: Generator, **options: Any) -> Generator:
    """A new Generator (own page pool, scheduler, prefix cache) over base's model and KV cache."""
    return Generator(base.model, base.cache, base.tokenizer, **options)


# -- (a) prefix dedup -------------------------------------------------------------


def prefix_workload(spec: PrefixSpec, allowed: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.choice(allowed) for _ in range(spec.system_tokens)]
    return [system + [rng.choice(allowed) for _ in range(spec.question_tokens)] for _ in range(spec.num_requests)]


def summarize_prefix(trace: RunTrace, prompts: Sequence[list[int]]) -> dict[str, Any]:
    ttft = [t[0] - trace.start for t in trace.token_times if t]
    generated = sum(len(t) for t in trace.tokens)
    return {
        "wall_s": round(trace.wall, 3),
        "prompt_tokens": sum(len(p) for p in prompts),
        "computed_prompt_tokens": trace.stats["computed_prompt_tokens"],
        "cached_prompt_tokens": trace.stats["cached_prompt_tokens"],
        "cached_tokens_from_results": sum(e.get("cached_tokens") or 0 for e in trace.eos),
        "generated_tokens": generated,
        "generated_tok_s": round(generated / trace.wall, 2),
        "ttft_ms": {**percentiles_ms(ttft, (50, 90)), "max": round(max(ttft) * 1e3, 3) if ttft else None},
        "per_request_ttft_ms": [round(t * 1e3, 2) for t in ttft],
        "steps": trace.stats["steps"],
        "preemptions": trace.stats["preemptions"],
    }


def bench_prefix(path: Path, spec: PrefixSpec, args: argparse.Namespace) -> dict[str, Any]:
    """The shared-prefix workload with dedup on and off, same model and cache."""
    per_request = pages_for(spec.system_tokens + spec.question_tokens + spec.max_new_tokens, args.page_size)
    cache_tokens = spec.num_requests * per_request * args.page_size
    base = Generator.from_pretrained(path, cache_tokens=cache_tokens, page_size=args.page_size)
    allowed = non_special_ids(base)
    prompts = prefix_workload(spec, allowed, args.seed)
    warmup_rng = random.Random(args.seed + 1000)
    warmup = [[warmup_rng.choice(allowed) for _ in range(48)] for _ in range(2)]
    options = {"max_batch_size": spec.num_requests, "max_chunk_size": args.chunk_size}
    progress(
        f"prefix: {spec.num_requests} requests x ({spec.system_tokens} shared + {spec.question_tokens}) prompt tokens, "
        f"{spec.max_new_tokens} new; cache {cache_tokens} tokens ({cache_tokens // args.page_size} pages)"
    )
    for dedup in (True, False):
        run_jobs(fresh(base, prefix_caching=dedup, **options), warmup, 4)
    runs: dict[str, list[dict[str, Any]]] = {"dedup_on": [], "dedup_off": []}
    tokens: dict[str, list[list[int]]] = {}
    for rep in range(args.repeats):
        for name, dedup in (("dedup_off", False), ("dedup_on", True)):
            trace = run_jobs(fresh(base, prefix_caching=dedup, **options), prompts, spec.max_new_tokens)
            summary = summarize_prefix(trace, prompts)
            runs[name].append(summary)
            tokens.setdefault(name, trace.tokens)
            if trace.tokens != tokens[name]:
                progress(f"warning: prefix {name} repetition {rep} produced different tokens than repetition 0")
            ttft = summary["ttft_ms"]
            progress(
                f"prefix {name} rep {rep}: computed {summary['computed_prompt_tokens']} prompt tokens, "
                f"cached {summary['cached_prompt_tokens']}, TTFT p50/p90/max {ttft['p50']:.0f}/{ttft['p90']:.0f}/"
                f"{ttft['max']:.0f} ms, wall {summary['wall_s']:.2f} s"
            )
            gc.collect()
    best = {name: min(reps, key=lambda r: r["wall_s"]) for name, reps in runs.items()}
    on, off = best["dedup_on"], best["dedup_off"]
    ratio = on["computed_prompt_tokens"] / off["computed_prompt_tokens"]
    match = compare_tokens(tokens["dedup_off"], tokens["dedup_on"])
    progress(
        f"prefix: dedup computes {ratio:.4f} of the prompt tokens (target <= {DEDUP_TARGET_RATIO:.3f}); "
        f"TTFT p50 {off['ttft_ms']['p50']:.0f} -> {on['ttft_ms']['p50']:.0f} ms; "
        f"outputs identical {match['identical_requests']}/{match['requests']}"
    )
    return {
        "workload": {
            **spec.__dict__, "seed": args.seed, "greedy": True, "eos": "ignored (stop_conditions=[])",
            "arrival": "all enqueued at once",
        },
        "generator": {**options, "cache_tokens": cache_tokens, "page_size": args.page_size},
        "runs": runs,
        "best": best,
        "computed_ratio_on_over_off": round(ratio, 5),
        "target_ratio": DEDUP_TARGET_RATIO,
        "target_met": ratio <= DEDUP_TARGET_RATIO,
        "ttft_p50_ratio_on_over_off": round(on["ttft_ms"]["p50"] / off["ttft_ms"]["p50"], 4),
        "wall_ratio_on_over_off": round(on["wall_s"] / off["wall_s"], 4),
        "outputs_identical": match,
    }


# -- (b) speculative decoding ------------------------------------------------------


def periodic(tokens: Sequence[int], max_period: int) -> int | None:
    """The smallest period <= max_period with which `tokens` repeats, or None."""
    for p in range(1, min(max_period, len(tokens) - 1) + 1):
        if all(tokens[i] == tokens[i + p] for i in range(len(tokens) - p)):
            return p
    return None


def select_loop_prompts(
    base: Generator, spec: SpecSpec, count: int, allowed: list[int], seed: int, args: argparse.Namespace
) -> tuple[list[list[int]], dict[str, Any]]:
    """The first `count` candidates (a short random pattern cycled to the prompt
    length) whose greedy probe continuation ends in a loop; see the module doc."""
    rng = random.Random(seed)
    kept: list[list[int]] = []
    kept_info: list[dict[str, Any]] = []
    probed = 0
    by_pattern = {p: [0, 0] for p in spec.patterns}  # pattern length -> [probed, looping]
    gen = fresh(base, max_batch_size=spec.probe_batch, max_chunk_size=args.chunk_size)
    while len(kept) < count and probed < spec.max_candidates:
        batch = []
        for _ in range(spec.probe_batch):
            period = spec.patterns[(probed + len(batch)) % len(spec.patterns)]
            pattern = [rng.choice(allowed) for _ in range(period)]
            batch.append((period, (pattern * spec.prompt_tokens)[: spec.prompt_tokens]))
        trace = run_jobs(gen, [p for _, p in batch], spec.probe_tokens)
        for k, ((period, prompt), out) in enumerate(zip(batch, trace.tokens)):
            by_pattern[period][0] += 1
            loop = periodic(out[-spec.probe_tail:], spec.max_loop_period)
            if loop is not None:
                by_pattern[period][1] += 1
                if len(kept) < count:
                    kept.append(prompt)
                    kept_info.append({"candidate": probed + k, "pattern_length": period, "loop_period": loop})
        probed += len(batch)
        progress(f"speculation: probed {probed} candidates, {len(kept)}/{count} loop")
    if len(kept) < count:
        raise RuntimeError(f"only {len(kept)} of {spec.max_candidates} candidate prompts loop; need {count}")
    return kept, {
        "candidates_probed": probed,
        "looping_by_pattern_length": {str(p): {"probed": a, "looping": b} for p, (a, b) in by_pattern.items()},
        "kept": kept_info,
    }


def replay(
    prompt: list[int], output: list[int], num_draft: int, max_ngram: int,
    drafter: Callable[[list[int], int, int], list[int]] = ngram_draft,
) -> dict[str, int]:
    """What greedy speculation with `drafter` does on this job, given the greedy
    output it must reproduce: the first token comes from the prefill, every later
    decode step drafts drafter(context) cut to the room left (as the scheduler
    does) and keeps the drafted tokens that match the output, plus one more."""
    context = list(prompt) + output[:1]
    i, drafted, accepted, steps, verify_steps = 1, 0, 0, 0, 0
    while i < len(output):
        room = min(num_draft, len(output) - i - 1)
        draft = drafter(context, max_ngram, num_draft)[: max(room, 0)] if room > 0 else []
        a = 0
        while a < len(draft) and draft[a] == output[i + a]:
            a += 1
        drafted += len(draft)
        accepted += a
        steps += 1
        verify_steps += bool(draft)
        context.extend(output[i : i + a + 1])
        i += a + 1
    return {"drafted": drafted, "accepted": accepted, "decode_steps": steps, "verify_steps": verify_steps}


def _sum_replays(prompts: Sequence[list[int]], outputs: Sequence[list[int]], k: int, drafter: Any) -> dict[str, int]:
    replays = [replay(p, out, k, 4, drafter) for p, out in zip(prompts, outputs)]
    return {f: sum(r[f] for r in replays) for f in replays[0]}


@dataclass(frozen=True)
class SpecConfig:
    name: str
    label: str
    options: dict[str, Any]
    batch_sizes: tuple[int, ...]  # where this configuration runs

    @property
    def speculates(self) -> bool:
        return bool(self.options.get("use_ngram_draft"))


def spec_configs(spec: SpecSpec) -> list[SpecConfig]:
    configs = [SpecConfig("off", "no speculation", {"use_ngram_draft": False}, spec.batch_sizes)]
    for k in spec.draft_lengths:
        configs.append(SpecConfig(
            f"ngram_k{k}", f"n-gram, {k} draft tokens",
            {"use_ngram_draft": True, "num_draft_tokens": k, "max_ngram": 4,
             "max_speculative_batch": SPECULATIVE_BATCH},
            spec.batch_sizes,
        ))
    k = spec.draft_lengths[0]
    large = tuple(b for b in spec.batch_sizes if b > DEFAULT_SPECULATIVE_BATCH)
    if large:
        configs.append(SpecConfig(
            f"ngram_k{k}_default_max_batch",
            f"n-gram, {k} draft tokens, default max_speculative_batch ({DEFAULT_SPECULATIVE_BATCH})",
            {"use_ngram_draft": True, "num_draft_tokens": k, "max_ngram": 4},
            large,
        ))
    return configs


def run_batch(gen_factory: Callable[[], Generator], prompts: list[list[int]], batch: int, new: int) -> RunTrace:
    """batch 1: the prompts one after another on one Generator (walls summed);
    otherwise: all prompts at once."""
    gen = gen_factory()
    if batch > 1:
        return run_jobs(gen, prompts, new)
    traces = [run_jobs(gen, [p], new) for p in prompts]
    stats = {k: sum(t.stats[k] for t in traces) for k in STAT_COUNTERS}
    merged = RunTrace(
        start=0.0, end=sum(t.wall for t in traces),
        tokens=[t.tokens[0] for t in traces], token_times=[t.token_times[0] for t in traces],
        token_steps=[t.token_steps[0] for t in traces], eos=[t.eos[0] for t in traces], stats=stats,
    )
    return merged


def summarize_spec(trace: RunTrace, config: SpecConfig, replay: dict[str, int] | None) -> dict[str, Any]:
    generated = sum(len(t) for t in trace.tokens)
    drafted, accepted = trace.stats["drafted_tokens"], trace.stats["accepted_draft_tokens"]
    summary: dict[str, Any] = {
        "wall_s": round(trace.wall, 4),
        "generated_tokens": generated,
        "generated_tok_s": round(generated / trace.wall, 2),
        "forward_steps": trace.stats["steps"],
        "drafted_tokens": drafted,
        "accepted_draft_tokens": accepted,
        "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
        "rejected_draft_tokens_from_results": sum(e.get("rejected_draft_tokens") or 0 for e in trace.eos),
        "accepted_draft_tokens_from_results": sum(e.get("accepted_draft_tokens") or 0 for e in trace.eos),
        "per_job_accepted_rejected": [
            [e.get("accepted_draft_tokens") or 0, e.get("rejected_draft_tokens") or 0] for e in trace.eos
        ],
        # the first token of a job comes from its prefill step, the rest from decode steps
        "tokens_per_decode_step": round(
            statistics.mean((len(t) - 1) / max(s - 1, 1) for t, s in zip(trace.tokens, trace.token_steps)), 4
        ),
    }
    if replay is not None:
        summary["replay"] = replay
        summary["verify_steps"] = replay["verify_steps"]
        summary["mean_accepted_per_verify_step"] = (
            round(replay["accepted"] / replay["verify_steps"], 4) if replay["verify_steps"] else None
        )
        summary["mean_draft_length"] = (
            round(replay["drafted"] / replay["verify_steps"], 4) if replay["verify_steps"] else None
        )
        summary["engine_matches_replay"] = (replay["drafted"], replay["accepted"]) == (drafted, accepted)
    return summary


def bench_speculation(path: Path, spec: SpecSpec, args: argparse.Namespace) -> dict[str, Any]:
    """Loop and random workloads at each batch size, each speculation configuration."""
    batch_max = max(spec.batch_sizes)
    k_max = max(spec.draft_lengths)
    per_job = pages_for(spec.prompt_tokens + spec.max_new_tokens + k_max + 1, args.page_size)
    probe_pages = spec.probe_batch * pages_for(spec.prompt_tokens + spec.probe_tokens + 1, args.page_size)
    cache_tokens = max(batch_max * per_job, probe_pages) * args.page_size
    base = Generator.from_pretrained(path, cache_tokens=cache_tokens, page_size=args.page_size)
    allowed = non_special_ids(base)
    progress(f"speculation: selecting {batch_max} loop prompts of {spec.prompt_tokens} tokens")
    loop_prompts, selection = select_loop_prompts(base, spec, batch_max, allowed, args.seed + 1, args)
    rng = random.Random(args.seed + 2)
    workloads = {
        "loop": loop_prompts,
        "random": [[rng.choice(allowed) for _ in range(spec.prompt_tokens)] for _ in range(batch_max)],
    }
    configs = spec_configs(spec)

    def factory(config: SpecConfig, batch: int) -> Callable[[], Generator]:
        return lambda: fresh(base, max_batch_size=max(batch, 1), max_chunk_size=args.chunk_size, **config.options)

    progress("speculation: warm-up of every configuration")
    warm = [[rng.choice(allowed) for _ in range(16)] * 4 for _ in range(2)]
    for config in configs:
        run_jobs(factory(config, 2)(), warm, 24)

    control = {"off", f"ngram_k{spec.draft_lengths[0]}"}  # the random workload only needs these
    cells = [
        (workload, batch, config)
        for workload in workloads
        for batch in spec.batch_sizes
        for config in configs
        if batch in config.batch_sizes and (workload == "loop" or config.name in control)
    ]
    walls: dict[tuple[str, int, str], list[float]] = {}
    traces: dict[tuple[str, int, str], RunTrace] = {}
    for rep in range(args.repeats):
        for workload, batch, config in cells:
            prompts = workloads[workload][: spec.batch1_prompts if batch == 1 else batch]
            trace = run_batch(factory(config, batch), prompts, batch, spec.max_new_tokens)
            key = (workload, batch, config.name)
            walls.setdefault(key, []).append(round(trace.wall, 4))
            if key in traces and trace.tokens != traces[key].tokens:
                progress(f"warning: {key} produced different tokens in repetition {rep}")
            if key not in traces or trace.wall < traces[key].wall:
                traces[key] = trace
            generated = sum(len(t) for t in trace.tokens)
            drafted, accepted = trace.stats["drafted_tokens"], trace.stats["accepted_draft_tokens"]
            progress(
                f"speculation rep {rep} {workload} batch {batch} {config.name}: "
                f"{generated / trace.wall:.1f} tok/s, accepted {accepted}/{drafted} drafted, wall {trace.wall:.2f} s"
            )
            gc.collect()

    results: dict[str, Any] = {}
    for workload in workloads:
        results[workload] = {}
        for batch in spec.batch_sizes:
            reference = traces[(workload, batch, "off")]
            prompts = workloads[workload][: spec.batch1_prompts if batch == 1 else batch]
            rows: dict[str, Any] = {}
            for config in configs:
                key = (workload, batch, config.name)
                if key not in traces:
                    continue
                replayed = None
                if config.speculates:
                    speculating = batch <= config.options.get("max_speculative_batch", DEFAULT_SPECULATIVE_BATCH)
                    k = config.options["num_draft_tokens"] if speculating else 0
                    replayed = _sum_replays(prompts, reference.tokens, k, ngram_draft)
                row = summarize_spec(traces[key], config, replayed)
                row["label"] = config.label
                row["options"] = config.options
                row["wall_s_all_repeats"] = walls[key]
                row["generated_tok_s_median"] = round(row["generated_tokens"] / statistics.median(walls[key]), 2)
                row["speedup"] = round(reference.wall / traces[key].wall, 4)  # same tokens generated
                row["outputs_identical_to_off"] = compare_tokens(reference.tokens, traces[key].tokens)
                rows[config.name] = row
            results[workload][str(batch)] = {"prompts": len(prompts), "configs": rows}
            if batch == 1:
                results[workload][str(batch)]["note"] = (
                    f"{len(prompts)} prompts run one after another, each alone; walls summed"
                )
    b1 = results["loop"]["1"]["configs"] if 1 in spec.batch_sizes else {}
    k_first = f"ngram_k{spec.draft_lengths[0]}"
    headline = b1.get(k_first, {}).get("speedup")
    best_k = max((r["speedup"] for n, r in b1.items() if n != "off"), default=None)
    return {
        "workload": {
            "prompt_tokens": spec.prompt_tokens, "max_new_tokens": spec.max_new_tokens,
            "batch_sizes": list(spec.batch_sizes), "batch1_prompts": spec.batch1_prompts,
            "greedy": True, "eos": "ignored (stop_conditions=[])", "seed": args.seed,
            "loop_selection": {
                "rule": (
                    f"candidates: a random pattern of {'/'.join(map(str, spec.patterns))} tokens (cycled over "
                    f"candidates) repeated to {spec.prompt_tokens} tokens, random.Random(seed + 1); probe: "
                    f"{spec.probe_tokens} greedy tokens without speculation; kept when the last {spec.probe_tail} "
                    f"probe tokens repeat with period <= {spec.max_loop_period}; the first {batch_max} kept"
                ),
                **selection,
            },
            "random": f"{batch_max} prompts of {spec.prompt_tokens} uniform non-special token ids, "
                      "random.Random(seed + 2), no selection",
        },
        "generator": {"cache_tokens": cache_tokens, "page_size": args.page_size, "max_chunk_size": args.chunk_size,
                      "max_batch_size": "the batch size"},
        "results": results,
        "target_speedup_batch1": SPEEDUP_TARGET,
        "speedup_batch1_loop": {"num_draft_tokens_4": headline, "best": best_k},
        "target_met": headline is not None and headline >= SPEEDUP_TARGET,
    }


# -- main ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    machine = start_run(args.threads)
    default = SpeculativeConfig().max_speculative_batch
    if default != DEFAULT_SPECULATIVE_BATCH:
        progress(f"warning: the engine's default max_speculative_batch is {default}, this script assumes "
                 f"{DEFAULT_SPECULATIVE_BATCH}")
    path = ensure_model(args.model)
    config = json.loads((path / "config.json").read_text())
    prefix_spec = QUICK_PREFIX if args.quick else FULL_PREFIX
    spec_spec = QUICK_SPEC if args.quick else FULL_SPEC
    needed = prefix_spec.system_tokens + prefix_spec.question_tokens + prefix_spec.max_new_tokens
    if "prefix" in args.parts and config["max_position_embeddings"] < needed:
        raise SystemExit(f"{args.model}: max_position_embeddings {config['max_position_embeddings']} < {needed}")
    results: dict[str, Any] = {
        "benchmark": "prefix_and_speculation",
        "machine": machine,
        "settings": {
            "quick": args.quick, "parts": args.parts, "model": args.model, "model_path": str(path),
            "parameters": count_parameters(config), "threads": args.threads, "repeats": args.repeats,
            "page_size": args.page_size, "chunk_size": args.chunk_size, "dtype": "float32", "seed": args.seed,
            "headline": "the fastest repetition of each configuration",
        },
        "method": __doc__,
    }
    started = time.perf_counter()
    if "prefix" in args.parts:
        results["prefix"] = bench_prefix(path, prefix_spec, args)
        gc.collect()
    if "speculation" in args.parts:
        results["speculation"] = bench_speculation(path, spec_spec, args)
    results["machine"]["bench_wall_s"] = round(time.perf_counter() - started, 1)
    write_results(results, args.out, "prefix_and_speculation", args.quick, plot, markdown_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
