"""Where one engine step spends its time, from torch.profiler (CPU).

Two steps are profiled on the benchmark's own workload: the first step after
enqueueing it (a pure prefill chunk of max_chunk_size prompt tokens) and the
first step after every prompt is computed (one decode row per running job).

Attribution: for the profiled step only, the kernel entry points the model calls
(kernels.paged_attention, write_kv, rms_norm, apply_rope, silu_and_mul, gelu_tanh_and_mul,
kernels.reference._attend, engine.rope.rope_cos_sin, engine.generator.sample,
BatchSampler.sample)
are wrapped in record_function labels; each op's self CPU time goes to the
category of its nearest labelled ancestor, else by the op's name:
  matmul         aten::mm/addmm/bmm outside the labels (projections, MLP, lm_head)
  attention      sdpa and the q/out row gather/scatter of paged_attention
  kv_gather      aten::index & co. inside _attend (reading pages into a dense K/V)
  kv_write       write_kv
  norm_rope_act  rms_norm, apply_rope, silu_and_mul, gelu_tanh_and_mul, rope_cos_sin
  sampling       sample
  other_ops      everything else (embedding, logits row select, batch tensors)
  python_overhead  step wall time minus the summed self time of all ops: the
                 scheduler, batch building, result dicts and Python between ops.
with_stack=True would attribute by Python frames without wrapping anything, but
its tracer keeps raw pointers to code objects and intermittently fails to parse
(UnicodeDecodeError in _parse_kineto_results, pytorch/pytorch#64345, #136040).
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from throughput_runners import Request
from torch.autograd.profiler_util import FunctionEvent
from torch.profiler import ProfilerActivity, profile, record_function

import engine.batch_sampler
import engine.generator
import engine.rope
import kernels
import kernels.reference
from engine import Generator, Job

METHOD = (
    "torch.profiler (CPU) over one iterate(): the first step after enqueueing the workload (prefill) and the "
    "first step after all prompts are computed (decode). During the step, the kernel entry points are wrapped "
    "in record_function labels; each op's self CPU time goes to its nearest label (write_kv -> kv_write; "
    "aten::index & co. in _attend -> kv_gather; the rest of paged_attention/_attend -> attention; rms_norm, "
    "apply_rope, silu_and_mul, rope_cos_sin -> norm_rope_act; sample -> sampling), else aten::mm/addmm/bmm "
    "-> matmul, else other_ops. python_overhead = step wall time - summed op self time."
)
CATEGORIES = (
    "matmul", "attention", "kv_gather", "kv_write", "norm_rope_act", "sampling", "other_ops", "python_overhead",
)
_LABEL = "genq-bench/"
_STEP_LABEL = _LABEL + "step"
# (module, attribute looked up at call time, category); absent attributes are skipped.
_WRAPPED: tuple[tuple[ModuleType, str, str], ...] = (
    (kernels, "paged_attention", "attention"),
    (kernels.reference, "_attend", "attention"),
    (kernels, "write_kv", "kv_write"),
    (kernels, "rms_norm", "norm_rope_act"),
    (kernels, "apply_rope", "norm_rope_act"),
    (kernels, "silu_and_mul", "norm_rope_act"),
    (kernels, "gelu_tanh_and_mul", "norm_rope_act"),
    (engine.rope, "rope_cos_sin", "norm_rope_act"),
    (engine.generator, "sample", "sampling"),
    (engine.batch_sampler.BatchSampler, "sample", "sampling"),
)
_MATMUL_OPS = frozenset(
    {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv", "aten::matmul", "aten::linear"}
)
_GATHER_OPS = frozenset({"aten::index", "aten::index_select", "aten::gather", "aten::take"})
_TOP_OPS = 15


def _labelled(function: Callable[..., Any], label: str) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function(label):
            return function(*args, **kwargs)

    return wrapper


@contextmanager
def _labelled_kernels() -> Iterator[None]:
    """Wrap the entry points in _WRAPPED for the duration of one profiled step."""
    saved: list[tuple[ModuleType, str, Any]] = []
    try:
        for module, name, category in _WRAPPED:
            original = getattr(module, name, None)
            if original is None:
                continue
            saved.append((module, name, original))
            setattr(module, name, _labelled(original, f"{_LABEL}{category}/{name}"))
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def _ancestors(event: FunctionEvent) -> Iterator[FunctionEvent]:
    parent = event.cpu_parent
    while parent is not None:
        yield parent
        parent = parent.cpu_parent


def categorize(event: FunctionEvent) -> str:
    """Category of an op event: its nearest label, else matmul or other_ops."""
    for parent in _ancestors(event):
        if parent.name.startswith(_LABEL) and parent.name != _STEP_LABEL:
            category, function = parent.name[len(_LABEL):].split("/", 1)
            if function == "_attend" and event.name in _GATHER_OPS:
                return "kv_gather"
            return category
    return "matmul" if event.name in _MATMUL_OPS else "other_ops"


def _is_op_in_step(event: FunctionEvent) -> bool:
    if event.name.startswith(_LABEL):
        return False
    return any(parent.name == _STEP_LABEL for parent in _ancestors(event))


def _profile_step(gen: Generator) -> dict[str, Any]:
    """Profile one iterate() and split its wall time into the categories."""
    before = gen.stats
    with _labelled_kernels(), profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        with record_function(_STEP_LABEL):
            gen.iterate()
        wall_us = (time.perf_counter() - start) * 1e6
    after = gen.stats
    by_category: dict[str, float] = defaultdict(float)
    by_op: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if not _is_op_in_step(event):
            continue
        category = categorize(event)
        by_category[category] += event.self_cpu_time_total
        entry = by_op[(event.name, category)]
        entry[0] += event.self_cpu_time_total
        entry[1] += 1
    op_total = sum(by_category.values())
    by_category["python_overhead"] = max(0.0, wall_us - op_total)
    top = sorted(by_op.items(), key=lambda item: item[1][0], reverse=True)[:_TOP_OPS]
    return {
        "wall_ms": round(wall_us / 1e3, 3),
        "prompt_tokens_computed": after.computed_prompt_tokens - before.computed_prompt_tokens,
        "tokens_generated": after.generated_tokens - before.generated_tokens,
        "running_jobs_after": after.active_jobs,
        "categories_ms": {c: round(by_category.get(c, 0.0) / 1e3, 3) for c in CATEGORIES},
        "categories_fraction": {c: round(by_category.get(c, 0.0) / wall_us, 4) for c in CATEGORIES},
        "top_ops_by_self_cpu": [
            {"op": name, "category": category, "self_ms": round(us / 1e3, 3), "calls": int(calls)}
            for (name, category), (us, calls) in top
        ],
    }


def profile_engine(gen: Generator, requests: Sequence[Request]) -> dict[str, Any]:
    """Run the workload again on an idle generator, profile its first (prefill)
    step and its first all-decode step, then cancel the rest. Each prompt is
    rotated by one token, so the prefix cache (which holds the first run's
    prompts) serves none of it and the prefill is really computed."""
    jobs = [Job(r.prompt[1:] + r.prompt[:1], r.max_new_tokens, stop_conditions=[]) for r in requests]
    for job in jobs:
        gen.enqueue(job)
    prompt_total = sum(len(r.prompt) for r in requests)
    base = gen.stats.computed_prompt_tokens
    prefill = _profile_step(gen)
    while gen.stats.computed_prompt_tokens - base < prompt_total:
        gen.iterate()
    decode = _profile_step(gen)
    for job in jobs:
        gen.cancel(job)
    while gen.num_remaining_jobs():
        gen.iterate()
    return {"method": METHOD, "prefill_step": prefill, "decode_step": decode}
