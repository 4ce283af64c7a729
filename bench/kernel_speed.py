"""Triton kernels vs their torch references (and paged attention vs torch's
scaled_dot_product_attention on an already-gathered, contiguous cache), at
Llama-3-8B shapes (hidden 4096, MLP 14336, 32 query / 8 KV heads of 128,
page size 16), bf16.

    python bench/kernel_speed.py            # needs a CUDA GPU; writes bench/results/kernels.{json,png}
    python bench/kernel_speed.py --smoke    # CPU: runs every case once at toy shapes in Triton's
                                       # interpreter (checks the script, times nothing)

Where no CUDA GPU exists the script says so and exits 0 without numbers: the
kernels are then verified in the interpreter only (tests/test_kernels.py).

Each row reports the median time (triton.testing.do_bench) and the effective
memory bandwidth = bytes the operation must read + write / time; these kernels
are memory-bound, so that figure against the GPU's peak is the one that matters.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench_common import RESULTS_DIR, results_json  # noqa: E402

from kernels import reference as ref  # noqa: E402

FULL = dict(hidden=4096, inter=14336, hq=32, hkv=8, d=128, page=16)
TOY = dict(hidden=64, inter=64, hq=4, hkv=2, d=64, page=16)


def bench(fn: Callable[[], Any], smoke: bool) -> float | None:
    """Median milliseconds (None in smoke mode, where fn runs once)."""
    if smoke:
        fn()
        return None
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def attention_inputs(q_lens: list[int], ctx_lens: list[int], s: dict[str, int], device: str, dtype: torch.dtype):
    page = s["page"]
    batch = len(q_lens)
    max_pages = max(-(-c // page) for c in ctx_lens)
    num_pages = batch * max_pages
    k_cache = torch.randn(s["hkv"], num_pages, page, s["d"], device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    page_table = torch.randperm(num_pages, device=device).view(batch, max_pages).int()
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    q = torch.randn(int(sum(q_lens)), s["hq"], s["d"], device=device, dtype=dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, page_table, cu, ctx


def gathered_for_sdpa(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pt: torch.Tensor, length: int,
                      s: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode batch (every context `length` long) as SDPA's best case: query [B, Hq, 1, D], and the
    cache already gathered into contiguous [B, Hkv, L, D] keys and values."""
    batch = pt.shape[0]
    pages_per = -(-length // s["page"])
    idx = pt[:, :pages_per].reshape(-1).long()
    keys = kc.index_select(1, idx).view(s["hkv"], batch, pages_per * s["page"], s["d"])
    keys = keys[:, :, :length].transpose(0, 1).contiguous()
    vals = vc.index_select(1, idx).view(s["hkv"], batch, pages_per * s["page"], s["d"])
    vals = vals[:, :, :length].transpose(0, 1).contiguous()
    return q.view(batch, 1, s["hq"], s["d"]).transpose(1, 2), keys, vals


def run(smoke: bool) -> list[dict[str, Any]]:
    from kernels import triton_kernels as tk

    device = "cpu" if smoke else "cuda"
    dtype = torch.bfloat16
    s = TOY if smoke else FULL
    el = 2  # bytes per bf16 element
    rows: list[dict[str, Any]] = []

    def record(name: str, shape: str, nbytes: int, timings: dict[str, Callable[[], Any]]) -> None:
        row: dict[str, Any] = {"kernel": name, "shape": shape, "bytes": nbytes}
        for impl, fn in timings.items():
            ms = bench(fn, smoke)
            row[f"{impl}_ms"] = ms
            row[f"{impl}_gbps"] = None if ms is None else nbytes / ms / 1e6
        rows.append(row)
        print(json.dumps(row), flush=True)

    tokens = 4 if smoke else 256
    x = torch.randn(tokens, s["hidden"], device=device, dtype=dtype)
    w = torch.randn(s["hidden"], device=device, dtype=dtype)
    r = torch.randn_like(x)
    record("rms_norm+residual", f"T={tokens} H={s['hidden']}", 5 * x.numel() * el, {
        "triton": lambda: tk.rms_norm(x, w, 1e-6, r), "torch": lambda: ref.rms_norm(x, w, 1e-6, r)})

    gu = torch.randn(tokens, 2 * s["inter"], device=device, dtype=dtype)
    record("silu_and_mul", f"T={tokens} I={s['inter']}", 3 * tokens * s["inter"] * el, {
        "triton": lambda: tk.silu_and_mul(gu), "torch": lambda: ref.silu_and_mul(gu)})

    q = torch.randn(tokens, s["hq"], s["d"], device=device, dtype=dtype)
    k = torch.randn(tokens, s["hkv"], s["d"], device=device, dtype=dtype)
    cos = torch.randn(tokens, s["d"], device=device)
    sin = torch.randn(tokens, s["d"], device=device)
    record("apply_rope", f"T={tokens} Hq={s['hq']} Hkv={s['hkv']} D={s['d']}",
           2 * (q.numel() + k.numel()) * el + 2 * cos.numel() * 4, {
               "triton": lambda: tk.apply_rope(q, k, cos, sin), "torch": lambda: ref.apply_rope(q, k, cos, sin)})

    pages = 64 if smoke else 4096
    k_cache = torch.zeros(s["hkv"], pages, s["page"], s["d"], device=device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    v = torch.randn_like(k)
    slots = torch.randperm(pages * s["page"], device=device)[:tokens]
    record("write_kv", f"T={tokens} Hkv={s['hkv']} D={s['d']}", 4 * k.numel() * el, {
        "triton": lambda: tk.write_kv(k, v, k_cache, v_cache, slots),
        "torch": lambda: ref.write_kv(k, v, k_cache, v_cache, slots)})

    cases = [("decode", [1] * 4, [40] * 4)] if smoke else [
        ("decode", [1] * 64, [2048] * 64),
        ("decode", [1] * 8, [8192] * 8),
        ("prefill chunk on cached prefix", [512] * 4, [1536] * 4),
        ("mixed", [256] + [1] * 32, [1024] + [2048] * 32),
    ]
    for label, q_lens, ctx_lens in cases:
        q, kc, vc, pt, cu, ctx = attention_inputs(q_lens, ctx_lens, s, device, dtype)
        scale = s["d"] ** -0.5
        kv_bytes = 2 * sum(ctx_lens) * s["hkv"] * s["d"] * el
        nbytes = kv_bytes + 2 * q.numel() * el
        timings: dict[str, Callable[[], Any]] = {
            "triton": partial(tk.paged_attention, q, kc, vc, pt, cu, ctx, scale),
            "torch": partial(ref.paged_attention, q, kc, vc, pt, cu, ctx, scale),
        }
        if label == "decode":
            qd, keys, vals = gathered_for_sdpa(q, kc, vc, pt, ctx_lens[0], s)
            timings["sdpa_gathered"] = partial(F.scaled_dot_product_attention, qd, keys, vals, scale=scale,
                                               enable_gqa=True)
        record(f"paged_attention {label}", f"q_lens={sorted(set(q_lens))}x{len(q_lens)} ctx={sorted(set(ctx_lens))}",
               nbytes, timings)
    return rows


def plot(rows: list[dict[str, Any]], path: Path, gpu: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    impls = ["triton", "torch", "sdpa_gathered"]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.27
    for i, impl in enumerate(impls):
        values = [row.get(f"{impl}_gbps") or 0.0 for row in rows]
        ax.bar([j + (i - 1) * width for j in range(len(rows))], values, width, label=impl)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([row["kernel"] for row in rows], rotation=25, ha="right", fontsize=8)
    ax.set_ylabel("effective bandwidth (GB/s)")
    ax.set_title(f"genq kernels vs torch, bf16, Llama-3-8B shapes, {gpu}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="toy shapes on CPU in Triton's interpreter; no timings")
    args = parser.parse_args()
    if args.smoke:
        run(smoke=True)
        print("smoke run: every case ran once in the interpreter; nothing timed, nothing written")
        return 0
    if not torch.cuda.is_available():
        print("bench/kernel_speed.py: no CUDA GPU on this machine; the Triton kernels were verified in "
              "Triton's interpreter only (tests/test_kernels.py). Nothing timed.")
        return 0
    gpu = torch.cuda.get_device_name()
    rows = run(smoke=False)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    out = {"gpu": gpu, "torch": torch.__version__, "dtype": "bfloat16", "rows": rows}
    (RESULTS_DIR / "kernels.json").write_text(results_json(out))
    plot(rows, RESULTS_DIR / "kernels.png", gpu)
    print(f"wrote {RESULTS_DIR / 'kernels.json'} and kernels.png ({gpu})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
