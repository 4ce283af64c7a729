"""Host overhead per engine step: the time a step spends outside the model forward.

On a GPU the forward of a real model at a large batch takes ~10-15 ms; whatever
the step does on the CPU besides (scheduling, building the batch, sampling
bookkeeping, penalties, detokenizing, stop strings, results) leaves the GPU idle
unless it is overlapped. On the tiny random model the forward is small, so the
host share of a step is measured directly:

  forward_ms  time inside the model's forward (forward pre/post hooks on the
              main model; the sum over the step's forward calls)
  sampler_ms  time inside the sampler's entry point (engine.generator.sample
              before the batched sampler existed, BatchSampler.sample after): on
              a GPU its tensor ops are device work, but on this CPU a sort or
              top-k over [256, vocab] alone takes milliseconds, so it is shown
              apart rather than hidden in either figure
  host_ms     iterate() wall time minus forward_ms (the issue's definition)
  host_excl_sampler_ms  host_ms minus sampler_ms: the pure host work (scheduling,
              batch building, detokenizing, stop strings, results)

Workload per point: N jobs (1, 64, 256) with 16-token prompts, all enqueued at
once; every job's prefill is run first, then W warm-up decode steps, then S
measured decode steps in which every job decodes one token (max_new_tokens is
large enough that no job finishes, and EOS never stops a job). Two settings:
  greedy   temperature 0, no stop strings
  sampled  temperature 0.8, top_p 0.9, top_k 50, repetition_penalty 1.1, and two
           stop strings that the output holds back on partial matches
With --overlap, each step's forward and sampling run on a worker thread while
the previous step's text and results are produced; host_ms is then the host
time the step still adds beyond its forward (what overlap did not hide).
The medians over the S steps are the headline (the machine may be shared: the
median is robust to a neighbour's bursts; p90 is recorded beside it). A busy
neighbour slows the forward and the host work alike, so host / forward (same
model, same run) compares runs taken under different load. With --clock cpu every
time is the benchmark thread's CPU time (time.thread_time) instead of wall time:
with one torch thread the forward, sampling and host work all run on that
thread, so time a neighbour takes from the machine while the thread waits for a
core is not counted, and runs on a shared machine compare far better (cache and
memory-bandwidth contention still count).

With --synthetic-forward-ms F the model's forward is a stand-in (SyntheticForward, in this
script only) that waits F ms with the GIL released, as a GPU forward's host thread waits for the
device, and returns fixed random logits (stop tokens masked, so no job ends); the scheduler, batch
building, sampler and text are the engine's own. Two generators, overlap off and on, are measured
point by point side by side in one run at 64 and 256 jobs, in wall time (a wait takes no CPU):
  step_ms     iterate() wall time
  host_excl_sampler_ms  step_ms minus forward_ms minus sampler_ms: the host time the step adds
              beyond its device work (the forward and the sampler's tensor ops, device work on a
              GPU), i.e. what the GPU would wait for
The two are stored as LABEL:overlap-off and LABEL:overlap-on.

To measure an older engine with this script, put its checkout first on
PYTHONPATH (`git archive REV | tar -x -C DIR`; PYTHONPATH=DIR) and pass
--label: the sampler timer falls back to engine.generator.sample there.

The engine is set up as the worker's startup leaves it: once loaded, its heap is settled
(engine/heap.py: collected, frozen, a higher young-generation threshold); engines before
engine/heap.py keep the collector's defaults.

With `--label NAME` the run is stored under that label; the labels already in
the JSON are kept, so docs/benchmarks.md's before/after table comes from one file.
The figure draws this run's labels only (the JSON holds dozens), or with
`--plot-labels PATTERN ...` the stored labels matching any of the shell-style patterns.
Writes bench/results/host_overhead.{json,png} (host_overhead_quick.* with
--quick) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib
import torch
from bench_common import (
    bench_parser,
    ensure_model,
    load_average,
    progress,
    save_figure,
    side_by_side,
    start_run,
    table_lines,
    write_results,
)

import engine.generator
from engine import Generator, Job, SamplerSettings
from engine.batch import ForwardBatch
from engine.synthetic import word_tokens

try:
    from engine.heap import settle_startup_heap
except ImportError:  # an engine before engine/heap.py (measured via PYTHONPATH): the collector's defaults
    settle_startup_heap = None

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BATCHES = (1, 64, 256)
SYNTHETIC_BATCHES = (64, 256)
SYNTHETIC_LOGITS = 8
WORD_BOOST = 4.0
"""Added to the word tokens' logits (standard normal elsewhere): greedy and top-k 50 draw words."""
SETTINGS = {
    "greedy": SamplerSettings.greedy(),
    "sampled": SamplerSettings(temperature=0.8, top_p=0.9, top_k=50, repetition_penalty=1.1),
}
STOP_STRINGS = {"greedy": [], "sampled": ["</answer>", "###"]}
PROMPT_TOKENS = 16
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = "wall"  # set from --clock before anything is timed


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser(__doc__, "10 measured steps; writes host_overhead_quick.*",
                          "About 30 s on the tiny model (--synthetic-forward-ms: about a minute).")
    parser.add_argument("--label", default="current", help="name this run is stored under in the JSON")
    parser.add_argument("--preset", default="tiny", help="tiny-model preset (default: tiny, ~5M parameters)")
    parser.add_argument("--steps", type=int, default=50, help="measured decode steps per point")
    parser.add_argument("--warmup", type=int, default=5, help="decode steps run before measuring")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the machine is shared)")
    parser.add_argument("--overlap", action="store_true",
                        help="Generator(overlap=True): the forward runs on a worker thread while the previous "
                             "step's text and results are produced; host_ms is then the host time left exposed")
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall",
                        help="wall: perf_counter; cpu: this thread's CPU time (a shared machine's load counts less)")
    parser.add_argument("--synthetic-forward-ms", type=float, default=None, metavar="F",
                        help="a forward that waits F ms with the GIL released (a GPU's, e.g. 10-15); measures "
                             "overlap off and on side by side, in wall time")
    parser.add_argument("--plot-labels", nargs="+", metavar="PATTERN",
                        help="draw the stored labels matching these shell-style patterns (default: this run's)")
    args = parser.parse_args(argv)
    if args.clock == "cpu" and (args.overlap or args.synthetic_forward_ms is not None):
        parser.error("--clock cpu times one thread; with overlap the forward and sampling run on another")
    return args


@dataclass
class SyntheticForward:
    """The model's forward replaced by a wait of fixed duration that releases the GIL (time.sleep),
    as the host thread of a GPU forward waits for the device. It returns one of a few fixed random
    logits tensors in turn (a copy: the sampler edits logits in place) in which the vocabulary's
    ordinary word tokens (engine/synthetic.py) stand out, so the jobs write words, as a trained model
    does, rather than the byte tokens a random model favours; stop tokens are masked, so no job ends.
    A bench device: the engine never has it."""

    seconds: float
    logits: list[torch.Tensor]
    calls: int = 0

    @classmethod
    def install(cls, gen: Generator, milliseconds: float) -> None:
        vocab = gen.model.config.vocab_size
        words = word_tokens(gen.tokenizer, vocab)
        source = torch.Generator().manual_seed(0)
        logits = [torch.randn(gen.max_batch_size, vocab, generator=source) for _ in range(SYNTHETIC_LOGITS)]
        for each in logits:
            each[:, words] += WORD_BOOST
            each[:, sorted(gen.tokenizer.eos_token_ids)] = float("-inf")
        gen.model.forward = cls(milliseconds / 1e3, logits)  # type: ignore[method-assign]

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        time.sleep(self.seconds)
        self.calls += 1
        return self.logits[self.calls % len(self.logits)][: batch.logits_indices.numel()].clone()


class ForwardTimer:
    """Sums the wall time spent inside a module's forward calls."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.total = 0.0
        self._start = 0.0
        module.register_forward_pre_hook(self._before)
        module.register_forward_hook(self._after)

    def _before(self, *_: Any) -> None:
        self._start = CLOCKS[_clock]()

    def _after(self, *_: Any) -> None:
        self.total += CLOCKS[_clock]() - self._start


class CallTimer:
    """Sums the wall time spent in one function, wrapped where its caller looks it up."""

    def __init__(self, owner: Any, name: str) -> None:
        self.total = 0.0
        function = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = CLOCKS[_clock]()
            try:
                return function(*args, **kwargs)
            finally:
                self.total += CLOCKS[_clock]() - start

        setattr(owner, name, timed)


def sampler_timer(gen: Generator) -> CallTimer:
    """Times whichever sampler entry point this engine version calls."""
    sampler = getattr(gen, "sampler", None)
    if sampler is not None:
        return CallTimer(sampler, "sample")
    return CallTimer(engine.generator, "sample")


def measure(gen: Generator, timer: ForwardTimer, sampler: CallTimer, num_jobs: int, mode: str, steps: int,
            warmup: int) -> dict[str, Any]:
    """Median host and forward time per decode step with num_jobs running."""
    vocab = gen.model.config.vocab_size
    generator = torch.Generator().manual_seed(num_jobs)
    jobs = [
        Job(
            torch.randint(5, vocab, (PROMPT_TOKENS,), generator=generator).tolist(),
            max_new_tokens=steps + warmup + 8,
            stop_conditions=STOP_STRINGS[mode],
            gen_settings=SETTINGS[mode],
            seed=i,
        )
        for i in range(num_jobs)
    ]
    for job in jobs:
        gen.enqueue(job)
    while gen.stats.computed_prompt_tokens < num_jobs * PROMPT_TOKENS or gen.num_pending_jobs():
        gen.iterate()
    for _ in range(warmup):
        gen.iterate()
    host: list[float] = []
    forward: list[float] = []
    sampling: list[float] = []
    step: list[float] = []
    for _ in range(steps):
        timer.total = sampler.total = 0.0
        start = CLOCKS[_clock]()
        results = gen.iterate()
        elapsed = CLOCKS[_clock]() - start
        if len(results) != num_jobs or any(r["eos"] for r in results):
            raise RuntimeError(f"expected {num_jobs} streaming results per step, got {len(results)}")
        forward.append(timer.total)
        sampling.append(sampler.total)
        host.append(elapsed - timer.total)
        step.append(elapsed)
    for job in jobs:
        gen.cancel(job)
    while gen.num_remaining_jobs():
        gen.iterate()
    return {
        "jobs": num_jobs,
        "mode": mode,
        "steps": steps,
        "host_ms": _ms(statistics.median(host)),
        "host_p90_ms": _ms(_p90(host)),
        "forward_ms": _ms(statistics.median(forward)),
        "forward_p90_ms": _ms(_p90(forward)),
        "sampler_ms": _ms(statistics.median(sampling)),
        "host_excl_sampler_ms": _ms(statistics.median([h - s for h, s in zip(host, sampling)])),
        "host_per_job_us": round(statistics.median(host) / num_jobs * 1e6, 2),
        "host_over_forward": round(statistics.median(host) / statistics.median(forward), 3),
        "step_ms": _ms(statistics.median(step)),
        # the fastest tenth: on a loaded machine, closer to what the step costs when nothing preempts it
        "step_p10_ms": _ms(_p10(step)),
        "host_excl_sampler_p10_ms": _ms(_p10([h - s for h, s in zip(host, sampling)])),
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def _p10(values: list[float]) -> float:
    return sorted(values)[int(0.1 * (len(values) - 1))]


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The runs to store, by label: one, or with --synthetic-forward-ms overlap off and on."""
    global _clock
    _clock = args.clock
    machine = start_run(args.threads)
    path = ensure_model(args.preset)
    steps = 10 if args.quick else args.steps
    cache_tokens = max(BATCHES) * (PROMPT_TOKENS + steps + args.warmup + 16)
    synthetic = args.synthetic_forward_ms
    overlaps = (False, True) if synthetic is not None else (args.overlap,)
    labels = [f"{args.label}:overlap-{'on' if o else 'off'}" if synthetic is not None else args.label
              for o in overlaps]
    engines = []
    for overlap in overlaps:
        options = {"overlap": True} if overlap else {}  # engines before the overlap option lack it
        gen = Generator.from_pretrained(path, cache_tokens=cache_tokens, max_batch_size=max(BATCHES), **options)
        if synthetic is not None:
            SyntheticForward.install(gen, synthetic)
        engines.append((gen, ForwardTimer(gen.model), sampler_timer(gen)))
    if settle_startup_heap is not None:
        settle_startup_heap()
    points: list[list[dict[str, Any]]] = [[] for _ in overlaps]
    for mode in SETTINGS:
        for num_jobs in SYNTHETIC_BATCHES if synthetic is not None else BATCHES:
            for label, (gen, timer, sampler), measured in zip(labels, engines, points):
                progress(f"{label}: {mode}, {num_jobs} jobs")
                measured.append(measure(gen, timer, sampler, num_jobs, mode, steps, args.warmup))
                progress(f"  step {measured[-1]['step_ms']} ms, host {measured[-1]['host_ms']} ms, "
                         f"forward {measured[-1]['forward_ms']} ms (medians)")
    return {label: {
        "machine": {**machine, "load_average_at_end": load_average()},
        "threads": args.threads,
        "clock": args.clock,
        "overlap": overlap,
        "synthetic_forward_ms": synthetic,
        "preset": args.preset,
        "heap_settled": settle_startup_heap is not None,
        "points": measured,
    } for label, overlap, measured in zip(labels, overlaps, points)}


def plot(results: dict[str, Any], path: Path, labels: Sequence[str]) -> None:
    """The runs of `labels`: one row for those with the model's forward, one for those with the synthetic forward."""
    runs = {label: results["runs"][label] for label in labels}
    groups = [[label for label, r in runs.items() if bool(r.get("synthetic_forward_ms")) is synthetic]
              for synthetic in (False, True)]
    groups = [group for group in groups if group]
    modes = list(SETTINGS)
    fig, axes = plt.subplots(len(groups), len(modes), figsize=(8 * len(modes), 5 * len(groups)), squeeze=False)
    for row, group in zip(axes, groups):
        batches = sorted({p["jobs"] for label in group for p in runs[label]["points"]})
        for ax, mode in zip(row, modes):
            for i, label in enumerate(group):
                points = [p for p in runs[label]["points"] if p["mode"] == mode]
                xs, width = side_by_side(len(batches), len(group), i)
                xs = [xs[batches.index(p["jobs"])] for p in points]
                bottom = [0.0] * len(points)
                for key, part, alpha in (("host_excl_sampler_ms", "host", 1.0), ("sampler_ms", "sampler", 0.6),
                                         ("forward_ms", "forward", 0.3)):
                    values = [p[key] for p in points]
                    ax.bar(xs, values, width, bottom=bottom, alpha=alpha, label=f"{label}: {part}")
                    bottom = [b + v for b, v in zip(bottom, values)]
            ax.set_xticks(range(len(batches)), [f"{n} jobs" for n in batches])
            forward = "synthetic forward" if runs[group[0]].get("synthetic_forward_ms") else "forward"
            ax.set_title(f"{mode}: median decode step (host, sampler, {forward} stacked)")
            ax.set_ylabel("ms per decode step")
            ax.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # outside: one entry per run and part
    save_figure(fig, path)


def table(results: dict[str, Any]) -> str:
    return "\n".join(table_lines(
        ["run", "mode", "jobs", "host ms/step", "host p90", "of which sampler", "host excl. sampler", "forward ms/step",
         "step ms", "host / forward", "host per job (µs)"], "llrrrrrrrrr",
        [[label, p["mode"], p["jobs"], *(f"{p[key]:.2f}" for key in ("host_ms", "host_p90_ms", "sampler_ms",
                                                                      "host_excl_sampler_ms", "forward_ms")),
          f"{p['step_ms']:.2f}" if "step_ms" in p else "",
          f"{p['host_ms'] / p['forward_ms']:.2f}", f"{p['host_per_job_us']:.1f}"]
         for label, run_result in results["runs"].items() for p in run_result["points"]]))


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    stem = "host_overhead_quick" if args.quick else "host_overhead"
    existing = args.out / f"{stem}.json"
    results: dict[str, Any] = {"method": __doc__, "runs": {}}
    if existing.exists():
        results["runs"] = json.loads(existing.read_text()).get("runs", {})
    current = run(args)
    results["runs"].update(current)
    if args.plot_labels:
        drawn = [label for label in results["runs"] if any(fnmatch.fnmatchcase(label, p) for p in args.plot_labels)]
        if not drawn:
            raise SystemExit(f"no stored label matches {args.plot_labels}")
    else:
        drawn = list(current)
    write_results(results, args.out, "host_overhead", args.quick, partial(plot, labels=drawn), table)


if __name__ == "__main__":
    main()
