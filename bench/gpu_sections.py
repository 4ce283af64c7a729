"""The measurements bench/gpu_acceptance.py makes on a CUDA device, one function a section; each
returns the section's JSON dict with "passed" where the section is a check. Run as part of that
script (a sibling import, like bench_common)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from bench_common import REPO_ROOT, percentiles_ms, progress
from gpu_roofline import StepBytes, decode_step_bytes, roofline_tokens_per_s

from engine.config import ModelConfig
from engine.model import CausalLM

#: tests/kernel_checks.py's groups that check one kernel each (its "engine" group is the parity section here)
KERNEL_GROUPS = ("rms_norm", "silu_and_mul", "gelu_tanh_and_mul", "apply_rope", "write_kv", "attention_decode",
                 "attention_prefill", "fp8_codec", "kv_quant_write", "kv_quant_attention")

#: bf16 logits tolerance, relative to the largest |logit| of the row: bf16 keeps 8 significant bits, so
#: each rounding is up to 2**-9 of the value; the engine (Triton paged attention, fused norms) and
#: transformers (SDPA, cuBLAS) round in different orders over a model's layers, which leaves a few
#: units in the last place at the logits (2**-7 = 0.8% each). 3% allows about four.
LOGIT_RTOL = 0.03
#: a greedy token may flip where transformers' top two logits are this close (twice the logit
#: tolerance: within it, either order is a correct bf16 answer); after a flip the two sequences
#: differ, so the rest of that completion is not compared.
NEAR_TIE_RTOL = 2 * LOGIT_RTOL


def random_model(config: dict[str, Any], dtype: torch.dtype, device: torch.device) -> CausalLM:
    """CausalLM of a config.json's contents, built on `device` with random N(0, 0.02) weights (no download)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = CausalLM(ModelConfig.from_dict(config))
    finally:
        torch.set_default_dtype(previous)
    model = model.to_empty(device=device)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.02)
    model.reset_buffers(device)
    return model.eval()


# -- (a) parity with transformers ----------------------------------------------------------------


def _engine_last_logits(model: Any, cache: Any, tokens: list[int], device: torch.device) -> torch.Tensor:
    """The engine's next-token logits after `tokens`, one prefill forward over pages 0.. in order."""
    from engine.batch import ForwardBatch

    n, pages = len(tokens), -(-len(tokens) // cache.page_size)
    batch = ForwardBatch(
        input_ids=torch.tensor(tokens, device=device), positions=torch.arange(n, device=device),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=device),
        context_lens=torch.tensor([n], dtype=torch.int32, device=device),
        page_table=torch.arange(pages, dtype=torch.int32, device=device).view(1, pages),
        slot_mapping=torch.arange(n, device=device), logits_indices=torch.tensor([n - 1], device=device))
    model.bind_cache(cache)
    return model(batch)[0].float()


def _hf_greedy(hf: Any, prompt: list[int], new_tokens: int, device: torch.device) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens, and at each the top-two margin relative to the row's largest |logit|."""
    out = hf(torch.tensor([prompt], device=device), use_cache=True)
    tokens: list[int] = []
    margins: list[float] = []
    for _ in range(new_tokens):
        logits = out.logits[0, -1].float()
        top = logits.topk(2)
        tokens.append(int(top.indices[0]))
        margins.append(float((top.values[0] - top.values[1]) / logits.abs().max()))
        out = hf(torch.tensor([[tokens[-1]]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return tokens, margins


def parity(workdir: Path, device: torch.device, prompts: int, new_tokens: int) -> dict[str, Any]:
    """The engine against transformers on one tiny random-weight Llama, both bf16 on the device."""
    import random

    from transformers import AutoModelForCausalLM

    from engine import Generator
    from engine.cache import KVCache
    from engine.weights import load_model
    from genq_dev.tiny_model import make_tiny_model
    from tests.engine_runs import greedy_completions

    path = make_tiny_model(workdir / "parity-llama", family="llama")
    dtype = torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model = load_model(path, device, dtype)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    requests = [[rng.randrange(vocab) for _ in range(rng.randint(1, 90))] for _ in range(prompts)]
    cache = KVCache.allocate(model.config, 16, 16, dtype, device)
    worst = 0.0
    with torch.inference_mode():
        for tokens in requests:
            want = hf(torch.tensor([tokens], device=device)).logits[0, -1].float()
            got = _engine_last_logits(model, cache, tokens, device)
            worst = max(worst, float((got - want).abs().max() / want.abs().max()))
        generator = Generator.from_pretrained(path, device=device, dtype=dtype, cache_tokens=8192, page_size=16)
        completions = greedy_completions(generator, requests, new_tokens)
        compared = agreed = 0
        flips: list[dict[str, Any]] = []
        for i, (prompt, got_tokens) in enumerate(zip(requests, completions)):
            want_tokens, margins = _hf_greedy(hf, prompt, new_tokens, device)
            first = next((j for j, (a, b) in enumerate(zip(got_tokens, want_tokens)) if a != b), None)
            compared += new_tokens if first is None else first + 1
            agreed += new_tokens if first is None else first
            if first is not None:
                flips.append({"prompt": i, "position": first, "relative_margin": round(margins[first], 5),
                              "near_tie": margins[first] <= NEAR_TIE_RTOL})
    passed = worst <= LOGIT_RTOL and all(flip["near_tie"] for flip in flips)
    return {
        "passed": passed, "model": "tiny random-weight Llama (genq_dev.tiny_model), bf16", "prompts": prompts,
        "new_tokens": new_tokens, "logits_max_relative_error": round(worst, 5), "logits_rtol": LOGIT_RTOL,
        "greedy_tokens_agreed": agreed, "greedy_tokens_compared": compared, "flips": flips,
        "near_tie_rtol": NEAR_TIE_RTOL,
    }


# -- (b) kernels against their references ------------------------------------------------------------


def kernel_checks() -> dict[str, Any]:
    """tests/kernel_checks.py's groups, compiled on the device (a fresh process a group)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "GENQ_FORCE_TRITON")}
    env.update(GENQ_KERNEL_CHECK_DEVICE="cuda", PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}")
    groups: dict[str, Any] = {}
    for group in KERNEL_GROUPS:
        progress(f"kernels: {group}")
        proc = subprocess.run([sys.executable, "tests/kernel_checks.py", group], cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=900)
        lines = proc.stdout.splitlines()
        groups[group] = {"passed": proc.returncode == 0, "cases": len(lines),
                         "failure": None if proc.returncode == 0 else proc.stderr.strip().splitlines()[-1:]}
    return {"passed": all(g["passed"] for g in groups.values()), "tolerances": {"float32": 1e-5, "bfloat16": 2e-2},
            "groups": groups}


# -- (c) paged attention speed ----------------------------------------------------------------------


def attention_speed(bandwidth_gbps: float | None) -> dict[str, Any]:
    """Paged attention decode vs SDPA on the cache already gathered (its best case), Llama-3-8B shapes, bf16."""
    import torch.nn.functional as F
    from kernel_speed import FULL, attention_inputs, bench, gathered_for_sdpa

    from kernels import triton_kernels as tk

    rows = []
    for batch, context in ((1, 4096), (16, 2048), (64, 2048), (256, 1024), (8, 8192)):
        progress(f"attention speed: batch {batch}, context {context}")
        q, kc, vc, pt, cu, ctx = attention_inputs([1] * batch, [context] * batch, FULL, "cuda", torch.bfloat16)
        scale = FULL["d"] ** -0.5
        qd, keys, vals = gathered_for_sdpa(q, kc, vc, pt, context, FULL)
        nbytes = 2 * batch * context * FULL["hkv"] * FULL["d"] * 2 + 2 * q.numel() * 2
        triton_ms = bench(partial(tk.paged_attention, q, kc, vc, pt, cu, ctx, scale), smoke=False)
        sdpa_ms = bench(partial(F.scaled_dot_product_attention, qd, keys, vals, scale=scale, enable_gqa=True),
                        smoke=False)
        floor_ms = None if bandwidth_gbps is None else nbytes / (bandwidth_gbps * 1e9) * 1e3
        rows.append({"batch": batch, "context": context, "bytes": nbytes, "paged_attention_ms": triton_ms,
                     "sdpa_gathered_ms": sdpa_ms, "roofline_ms": floor_ms,
                     "paged_attention_roofline_fraction": None if floor_ms is None or not triton_ms
                     else round(floor_ms / triton_ms, 3)})
    return {"shapes": "Llama-3-8B: 32 query / 8 KV heads of 128, page 16, bf16", "rows": rows}


# -- (d) end-to-end decode ----------------------------------------------------------------------------


def decode_throughput(workdir: Path, device: torch.device, batches: list[int], context: int, steps: int,
                      bandwidth_gbps: float | None) -> dict[str, Any]:
    """Decode tokens/s of a Generator over Llama-3.1-8B with random weights, with and without CUDA graphs."""
    from engine import Generator, Job
    from engine.cache import KVCache
    from engine.engine_config import EngineConfig
    from engine.named_configs import NAMED_CONFIGS
    from engine.tokenizer import Tokenizer
    from genq_dev.tiny_model import write_tokenizer_files

    name = "llama-3.1-8b"
    tokenizer = Tokenizer.from_pretrained(write_tokenizer_files(workdir / "tokenizer", 512, "llama"))
    model = random_model(NAMED_CONFIGS[name], torch.bfloat16, device)
    config = model.config
    rows = []
    for graphs in (False, True):
        for batch in batches:
            progress(f"decode: batch {batch}, CUDA graphs {'on' if graphs else 'off'}")
            options = EngineConfig().with_options(max_batch_size=batch, cuda_graphs=graphs, page_size=16)
            pages = batch * (-(-(context + steps + 16) // 16))
            cache = KVCache.allocate(config, pages, 16, torch.bfloat16, device)
            generator = Generator(model, cache, tokenizer, options)
            generator.warmup()
            rows.append(_timed_decode(generator, Job, batch, context, steps, graphs, config, bandwidth_gbps))
            del generator, cache
            torch.cuda.empty_cache()
    return {"model": f"{name} shapes, random weights, bf16, fp16 KV cache (auto)", "context": context,
            "timed_steps": steps, "rows": rows}


def _timed_decode(generator: Any, job_type: Any, batch: int, context: int, steps: int, graphs: bool,
                  config: ModelConfig, bandwidth_gbps: float | None) -> dict[str, Any]:
    """Prefill `batch` prompts of `context` tokens, then time `steps` steps in which every job decodes."""
    prompt = [1 + i % 500 for i in range(context)]
    warm = 3
    generator.enqueue([job_type(prompt, 1 + warm + steps + 1, stop_conditions=[], identifier=i)
                       for i in range(batch)])
    produced = [0] * batch
    while min(produced) == 0:  # prefill, chunk by chunk
        for result in generator.iterate():
            produced[result["identifier"]] += len(result["token_ids"])
    for _ in range(warm):
        generator.iterate()
    torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = 0
    for _ in range(steps):
        tokens += sum(len(result["token_ids"]) for result in generator.iterate())
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    while generator.num_remaining_jobs():
        generator.iterate()
    mean_context = context + 1 + warm + steps // 2
    step: StepBytes = decode_step_bytes(config, batch, mean_context, 2)
    measured = tokens / elapsed
    roofline = None if bandwidth_gbps is None else roofline_tokens_per_s(step, batch, bandwidth_gbps)
    return {"batch": batch, "cuda_graphs": graphs, "tokens": tokens, "seconds": round(elapsed, 4),
            "tokens_per_s": round(measured, 1), "step_ms": round(elapsed / steps * 1e3, 3),
            "bytes_per_step": {"weights": step.weights, "kv": step.kv},
            "roofline_tokens_per_s": None if roofline is None else round(roofline, 1),
            "roofline_fraction": None if roofline is None else round(measured / roofline, 3)}


# -- (e) a burst through a real worker -----------------------------------------------------------------


def worker_burst(workdir: Path, tasks: int, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """`tasks` requests sent at once to a real `genq worker` on the device (a private redis-server, a
    tiny random Llama: what is measured is the service around the engine, not the model)."""
    import redis
    from celery import Celery
    from service_runners import run_service
    from throughput_runners import Request

    from genq_dev.tiny_model import make_tiny_model
    from worker.processes import RedisServer, WorkerProcess

    path = make_tiny_model(workdir / "burst-llama", family="llama")
    requests = [Request([1 + (i + j) % 200 for j in range(prompt_len)], new_tokens) for i in range(tasks)]
    options = {"device": "cuda", "dtype": "bfloat16", "concurrency": tasks, "max_batch_size": tasks,
               "shutdown_grace": 0}
    with RedisServer(workdir / "redis", persistence="none") as server:
        client = Celery("gpu-acceptance", broker=server.url, backend=server.url)
        redis_client = redis.Redis.from_url(server.url)
        try:
            with WorkerProcess(path, server.url, "gpu-acceptance", "gpu-acceptance", workdir / "worker.log",
                               options) as worker:
                progress("burst: waiting for the worker to load its engine")
                worker.wait_ready(client, timeout=300)
                run_service(client, redis_client, requests[:4], "gpu-acceptance", "warmup", 300)
                progress(f"burst: {tasks} tasks at once")
                trace, _ = run_service(client, redis_client, requests, "gpu-acceptance", "burst", 600)
        finally:
            redis_client.close()
            client.close()
    first = [times[0] - trace.start for times in trace.token_times if times]
    total = sum(len(t) for t in trace.tokens)
    seconds = trace.end - trace.start
    return {"model": "tiny random-weight Llama (genq_dev.tiny_model), bf16", "tasks": tasks,
            "prompt_tokens": prompt_len, "new_tokens": new_tokens, "completed": len(first),
            "passed": len(first) == tasks and total == tasks * new_tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(total / seconds, 1), "tasks_per_s": round(tasks / seconds, 2),
            "time_to_first_token_ms": percentiles_ms(first, (50, 99))}
