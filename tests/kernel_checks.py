"""Kernel-vs-reference checks, run by tests/test_kernels.py in a fresh process
per group with TRITON_INTERPRET=1 set before triton is imported.

    TRITON_INTERPRET=1 python tests/kernel_checks.py GROUP
    GENQ_KERNEL_CHECK_DEVICE=cuda python tests/kernel_checks.py GROUP   # compiled, on a GPU
                                                        (bench/gpu_acceptance.py runs it so)

Each check compares a Triton kernel with its torch reference (kernels/reference.py)
and raises AssertionError with the worst error; prints one line per case.
"""

from __future__ import annotations

import os
import sys

DEVICE = os.environ.get("GENQ_KERNEL_CHECK_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
torch.set_default_device(DEVICE)  # the checks' tensors, made with generators on DEVICE

from kernels import kv_cache_format  # noqa: E402
from kernels import reference as ref  # noqa: E402
from kernels import triton_kernels as tk  # noqa: E402

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = (torch.float32, torch.bfloat16)


def close(name: str, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    print(f"{name}: max abs err {err:.3g}")
    assert err <= TOL[dtype], f"{name}: max abs err {err} > {TOL[dtype]}"


def check_rms_norm() -> None:
    g = torch.Generator(DEVICE).manual_seed(0)
    for dtype in DTYPES:
        for shape in ((5, 64), (3, 4, 64), (2, 48)):  # 48: a non-power-of-two width
            x = torch.randn(shape, generator=g).to(dtype)
            w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype)
            r = torch.randn(shape, generator=g).to(dtype)
            got, none = tk.rms_norm(x, w, 1e-6)
            want, _ = ref.rms_norm(x, w, 1e-6)
            assert none is None
            close(f"rms_norm {dtype} {shape}", got, want, dtype)
            got, got_res = tk.rms_norm(x, w, 1e-6, r)
            want, want_res = ref.rms_norm(x, w, 1e-6, r)
            close(f"rms_norm+residual {dtype} {shape}", got, want, dtype)
            close(f"rms_norm residual-out {dtype} {shape}", got_res, want_res, dtype)
            # Gemma's (1 + weight) in fp32, with and without the residual
            close(f"rms_norm unit_offset {dtype} {shape}", tk.rms_norm(x, w - 1, 1e-6, None, True)[0],
                  ref.rms_norm(x, w - 1, 1e-6, None, True)[0], dtype)
            got, got_res = tk.rms_norm(x, w - 1, 1e-6, r, True)
            want, want_res = ref.rms_norm(x, w - 1, 1e-6, r, True)
            close(f"rms_norm unit_offset+residual {dtype} {shape}", got, want, dtype)
            close(f"rms_norm unit_offset residual-out {dtype} {shape}", got_res, want_res, dtype)
        # a strided input: the q slice of a fused qkv projection, as the engine's q_norm sees it
        qkv = torch.randn(3, 2 * 64 + 64, generator=g).to(dtype)
        q = qkv[:, :128].reshape(3, 2, 64)
        w = torch.randn(64, generator=g).to(dtype)
        close(f"rms_norm strided {dtype}", tk.rms_norm(q, w, 1e-5)[0], ref.rms_norm(q, w, 1e-5)[0], dtype)


def check_silu_and_mul() -> None:
    g = torch.Generator(DEVICE).manual_seed(1)
    for dtype in DTYPES:
        for shape in ((4, 2 * 96), (2, 3, 2 * 64), (1, 2 * 1500)):  # 1500 > one 1024-wide block
            x = (2 * torch.randn(shape, generator=g)).to(dtype)
            close(f"silu_and_mul {dtype} {shape}", tk.silu_and_mul(x), ref.silu_and_mul(x), dtype)


def check_gelu_tanh_and_mul() -> None:
    g = torch.Generator(DEVICE).manual_seed(4)
    for dtype in DTYPES:
        for shape in ((4, 2 * 96), (2, 3, 2 * 64), (1, 2 * 1500)):
            x = (3 * torch.randn(shape, generator=g)).to(dtype)
            close(f"gelu_tanh_and_mul {dtype} {shape}", tk.gelu_tanh_and_mul(x), ref.gelu_tanh_and_mul(x), dtype)


def check_apply_rope() -> None:
    g = torch.Generator(DEVICE).manual_seed(2)
    for dtype in DTYPES:
        # the last two rotate part of each head only (partial rotary: 48 of 64, 24 of 32 dims)
        for tokens, hq, hkv, d, rotary in ((5, 4, 1, 64, 64), (3, 8, 8, 128, 128), (2, 6, 2, 32, 32), (4, 4, 2, 64, 48),
                                           (3, 2, 1, 32, 24)):
            q = torch.randn(tokens, hq, d, generator=g).to(dtype)
            k = torch.randn(tokens, hkv, d, generator=g).to(dtype)
            pos = torch.arange(tokens).float() * 37
            inv = 1.0 / 10000 ** (torch.arange(0, rotary, 2).float() / rotary)
            freqs = torch.outer(pos, inv)
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            q1, k1, q2, k2 = q.clone(), k.clone(), q.clone(), k.clone()
            assert tk.apply_rope(q1, k1, cos, sin) is None
            ref.apply_rope(q2, k2, cos, sin)
            close(f"apply_rope q {dtype} {(tokens, hq, hkv, d, rotary)}", q1, q2, dtype)
            close(f"apply_rope k {dtype} {(tokens, hq, hkv, d, rotary)}", k1, k2, dtype)
            if rotary < d:
                assert torch.equal(q1[..., rotary:], q[..., rotary:]), "partial rotary changed the pass-through dims"


def check_write_kv() -> None:
    g = torch.Generator(DEVICE).manual_seed(3)
    for dtype in DTYPES:
        hkv, pages, page_size, d = 2, 5, 4, 64
        tokens = 7
        slots = torch.randperm(pages * page_size, generator=g)[:tokens]  # crosses page boundaries
        k = torch.randn(tokens, hkv, d, generator=g).to(dtype)
        v = torch.randn(tokens, hkv, d, generator=g).to(dtype)
        caches = [torch.randn(hkv, pages, page_size, d, generator=g).to(dtype) for _ in range(2)]
        kc1, vc1 = (c.clone() for c in caches)
        kc2, vc2 = (c.clone() for c in caches)
        tk.write_kv(k, v, kc1, vc1, slots)
        ref.write_kv(k, v, kc2, vc2, slots)
        assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2), f"write_kv {dtype}: caches differ"
        # a strided k/v (slices of a fused projection) and int32 slots
        kv = torch.randn(tokens, 2 * hkv * d, generator=g).to(dtype)
        k, v = kv[:, : hkv * d].view(tokens, hkv, d), kv[:, hkv * d :].view(tokens, hkv, d)
        tk.write_kv(k, v, kc1, vc1, slots.int())
        ref.write_kv(k, v, kc2, vc2, slots)
        assert torch.equal(kc1, kc2) and torch.equal(vc1, vc2), f"write_kv strided {dtype}: caches differ"
        print(f"write_kv {dtype}: exact")


def _attention_case(
    q_lens: list[int],
    ctx_lens: list[int],
    hkv: int,
    group: int,
    d: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
    window: int | None = None,
    softcap: float | None = None,
    kv_names: tuple[str, str] | None = None,
    **tiling: int,
) -> None:
    """Triton vs reference paged attention over one batch; kv_names: the K and V cache formats
    (_quantized_cache's names), else a cache of random values in dtype."""
    g = torch.Generator(DEVICE).manual_seed(seed)
    batch = len(q_lens)
    max_pages = max(-(-c // page_size) for c in ctx_lens) + 1  # one padding column
    num_pages = batch * max_pages + 3
    formats = ""
    if kv_names is None:
        k_cache = torch.randn(hkv, num_pages, page_size, d, generator=g).to(dtype)
        v_cache = torch.randn(hkv, num_pages, page_size, d, generator=g).to(dtype)
        k_scales = v_scales = None
    else:
        (k_cache, k_scales), (v_cache, v_scales) = (
            _quantized_cache(name, hkv, num_pages, page_size, d, g) for name in kv_names
        )
        # values of a realistic size (an outlier channel in K), written through the reference
        slots = num_pages * page_size
        k = torch.randn(slots, hkv, d, generator=g)
        k[..., 3] *= 10
        ref.write_kv(k, torch.randn(slots, hkv, d, generator=g), k_cache, v_cache, torch.arange(slots), k_scales,
                     v_scales)
        formats = f"K {kv_names[0]} V {kv_names[1]} "
    # scattered, non-monotonic physical pages; padding entries point at a valid page
    page_table = torch.randperm(num_pages, generator=g)[: batch * max_pages].view(batch, max_pages).int()
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hkv * group, d, generator=g).to(dtype)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    args = (q, k_cache, v_cache, page_table, cu, ctx, d**-0.5, window, softcap, k_scales, v_scales)
    want = ref.paged_attention(*args)
    got = tk.paged_attention(*args, **tiling)
    close(
        f"paged_attention {formats}q_lens={q_lens} ctx={ctx_lens} hkv={hkv} G={group} D={d} page={page_size} "
        f"window={window} softcap={softcap} {tiling} {dtype}",
        got, want, dtype,
    )


def check_attention_decode() -> None:
    """Decode-only batches: the split-K path with the log-sum-exp merge."""
    for dtype in DTYPES:
        # contexts of one token, exactly one page, one past a page boundary, several pages; GQA 1/4/8
        _attention_case([1, 1, 1, 1], [1, 16, 17, 45], hkv=2, group=4, d=64, page_size=16, dtype=dtype, seed=10)
        _attention_case([1, 1], [1, 33], hkv=1, group=8, d=64, page_size=8, dtype=dtype, seed=11, num_splits=3)
        _attention_case([1, 1, 1], [5, 8, 9], hkv=2, group=1, d=64, page_size=4, dtype=dtype, seed=12, num_splits=1)
    _attention_case([1, 1], [2, 40], hkv=2, group=4, d=128, page_size=16, dtype=torch.float32, seed=13)
    _attention_case([1, 1], [3, 40], hkv=1, group=4, d=64, page_size=8, dtype=torch.float32, seed=14, window=7)
    # Gemma 2: soft-capped scores (a cap small enough to bend them), with and without a window, split and not
    for dtype in DTYPES:
        _attention_case([1, 1, 1], [5, 17, 40], hkv=2, group=2, d=64, page_size=8, dtype=dtype, seed=15, softcap=1.5)
    _attention_case([1, 1], [9, 33], hkv=1, group=4, d=64, page_size=8, dtype=torch.float32, seed=16, window=6,
                    softcap=2.0, num_splits=1)


def check_attention_prefill() -> None:
    """Prefill chunks (cached prefix + causal self) and mixed prefill/decode batches."""
    for dtype in DTYPES:
        # mixed: a fresh prefill, a chunk on a cached prefix crossing a page boundary, a decode, a one-token context
        _attention_case([7, 5, 1, 1], [7, 21, 30, 1], hkv=2, group=4, d=64, page_size=8, dtype=dtype, seed=20)
        _attention_case([9, 1], [12, 17], hkv=1, group=8, d=64, page_size=4, dtype=dtype, seed=21)
        _attention_case([20, 1, 3], [20, 2, 40], hkv=2, group=1, d=64, page_size=16, dtype=dtype, seed=22)
    # splits on a mixed batch, head_dim 128, sliding window (also across chunk and page boundaries)
    _attention_case([6, 1], [14, 25], hkv=2, group=4, d=64, page_size=8, dtype=torch.float32, seed=23, num_splits=2)
    _attention_case([5, 1], [9, 20], hkv=1, group=4, d=128, page_size=8, dtype=torch.float32, seed=24)
    _attention_case([12, 1], [30, 19], hkv=2, group=4, d=64, page_size=4, dtype=torch.float32, seed=25, window=6)
    _attention_case([12, 1], [30, 19], hkv=2, group=4, d=64, page_size=4, dtype=torch.bfloat16, seed=25, window=6)
    # a GQA ratio that is not a power of two, and a page size that is not one either
    _attention_case([4, 1], [11, 7], hkv=2, group=3, d=64, page_size=6, dtype=torch.float32, seed=26)
    # soft-capping on a mixed batch, alone and with a window (Gemma 2's sliding layers)
    for dtype in DTYPES:
        _attention_case([7, 1, 3], [7, 20, 26], hkv=2, group=2, d=64, page_size=8, dtype=dtype, seed=27, softcap=1.5)
    _attention_case([12, 1], [30, 19], hkv=2, group=4, d=64, page_size=4, dtype=torch.float32, seed=28, window=6,
                    softcap=2.0)


def _quantized_cache(fmt_name: str, hkv: int, pages: int, page_size: int, d: int, g: torch.Generator):
    """A cache of format fmt_name (fp8, q8, q4, or auto: fp32) filled with arbitrary
    bits (as reused pages hold), and its scales (None for auto)."""
    if fmt_name == "auto":
        return torch.randn(hkv, pages, page_size, d, generator=g), None
    fmt = kv_cache_format(fmt_name, d, torch.float32).k
    data = torch.randint(0, 256, (hkv, pages, page_size, fmt.data_dim), generator=g, dtype=torch.uint8)
    data[data.view(torch.float8_e4m3fn).float().isnan()] = 0  # no NaN patterns: fp8 caches never hold them
    scales = torch.rand(hkv, pages, page_size, fmt.scale_groups, generator=g).half() + 0.01
    return data.view(fmt.data_dtype), scales


def _slots(x: torch.Tensor) -> torch.Tensor:
    """A cache or scales tensor's bytes as [heads, slots, bytes per slot]."""
    return x.view(torch.uint8).reshape(x.shape[0], x.shape[1] * x.shape[2], -1)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is None or b is None:
        return a is b
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def check_fp8_codec() -> None:
    """The kernels' hand-written e4m3fn encode/decode against torch's: every bit
    pattern decodes exactly; every grid value, every midpoint between neighbours
    (ties: round half to even), subnormals, +-0 and random values encode to torch's bits."""
    import triton
    import triton.language as tl

    @triton.jit
    def roundtrip(x_ptr, bits_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        tl.store(bits_ptr + i, tk._float_to_fp8(tl.load(x_ptr + i, mask=mask, other=0.0)), mask=mask)
        tl.store(y_ptr + i, tk._fp8_to_float(tl.load(bits_ptr + i, mask=mask, other=0)), mask=mask)

    patterns = torch.arange(256, dtype=torch.uint8)
    grid = patterns.view(torch.float8_e4m3fn).float()
    grid = grid[~grid.isnan()].unique()  # sorted, -448 .. 448
    mids = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator(DEVICE).manual_seed(30)
    rand = torch.cat((torch.randn(2000, generator=g) * 30, torch.randn(500, generator=g) * 0.01))
    x = torch.cat((grid, mids, rand.clamp(-448, 448), torch.tensor([0.0, -0.0, 448.0, -448.0, 2**-10, -(2**-10)])))
    bits = torch.empty(x.shape, dtype=torch.uint8)
    y = torch.empty_like(x)
    roundtrip[(triton.cdiv(x.numel(), 512),)](x, bits, y, x.numel(), BLOCK=512)
    want = x.to(torch.float8_e4m3fn)
    wrong = bits != want.view(torch.uint8)
    assert not wrong.any(), f"fp8 encode: {int(wrong.sum())} of {x.numel()} differ from torch, e.g. {x[wrong][:5]}"
    assert torch.equal(y, want.float()), "fp8 decode differs from torch"
    print(f"fp8 codec: {x.numel()} values bit-exact ({len(mids)} ties)")


#: (K format, V format): each format for both, k8v4's q8 keys / q4 values, and float keys with q4 values
KV_PAIRS = (("fp8", "fp8"), ("q8", "q8"), ("q4", "q4"), ("q8", "q4"), ("auto", "q4"))


def check_kv_quant_write() -> None:
    """Quantizing write_kv: Triton bits equal the reference's (data and scales) for
    every format, K and V in different formats, and activation dtypes; only the
    targeted slots change; a negative (padding) slot writes nothing; strided K/V
    and int32 slots."""
    g = torch.Generator(DEVICE).manual_seed(31)
    configs = ((torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 96))
    for k_name, v_name in KV_PAIRS:
        mixed = k_name != v_name
        for dtype, d in configs[1:] if mixed else configs:
            hkv, pages, page_size, tokens = 2, 5, 4, 7
            slots = torch.randperm(pages * page_size, generator=g)[:tokens]
            kv = (3 * torch.randn(tokens, 2 * hkv * d, generator=g)).to(dtype)
            kv[2] = 0  # a zero vector: smallest scale, zeros stored
            kv[:, 5] *= 20  # an outlier channel
            k, v = kv[:, : hkv * d].view(tokens, hkv, d), kv[:, hkv * d :].view(tokens, hkv, d)
            caches = [_quantized_cache(name, hkv, pages, page_size, d, g) for name in (k_name, v_name)]
            (kc1, ks1), (vc1, vs1) = [(c.clone(), s if s is None else s.clone()) for c, s in caches]
            (kc2, ks2), (vc2, vs2) = [(c.clone(), s if s is None else s.clone()) for c, s in caches]
            padded = torch.cat((slots[:3], torch.tensor([-1]), slots[3:])).int()
            k_pad = torch.cat((k[:3], 100 * torch.ones_like(k[:1]), k[3:]))
            v_pad = torch.cat((v[:3], 100 * torch.ones_like(v[:1]), v[3:]))
            tk.write_kv(k_pad, v_pad, kc1, vc1, padded, ks1, vs1)
            ref.write_kv(k, v, kc2, vc2, slots, ks2, vs2)
            case = f"write_kv K {k_name} V {v_name} {dtype} D={d}"
            for got, want in ((kc1, kc2), (vc1, vc2), (ks1, ks2), (vs1, vs2)):
                assert _same_bits(got, want), f"{case}: Triton and reference caches differ"
            untouched = torch.ones(pages * page_size, dtype=torch.bool)
            untouched[slots] = False
            for after, before in ((kc1, caches[0][0]), (ks1, caches[0][1]), (vc1, caches[1][0]), (vs1, caches[1][1])):
                if after is None:
                    continue
                same = torch.equal(_slots(after)[:, untouched], _slots(before)[:, untouched])
                assert same, f"{case}: other slots changed"
            print(f"{case}: exact")


def check_kv_quant_attention() -> None:
    """Paged attention over fp8 / q8 / q4 caches and K and V in different formats
    (k8v4's q8 / q4; float keys with q4 values), Triton vs reference: split-K
    decodes, verify rows, a prefill chunk, GQA, partial pages, window, soft-cap."""
    for i, kv_names in enumerate(KV_PAIRS):
        seed = 40 + 10 * i
        if kv_names[0] == "auto":  # what differs is only which tiles are dequantized: one case
            _attention_case([3, 1, 18, 5], [7, 6, 22, 13], hkv=1, group=2, d=64, page_size=4,
                            dtype=torch.float32, seed=seed, kv_names=kv_names)
            continue
        _attention_case([1, 1, 1], [1, 9, 14], hkv=2, group=2, d=64, page_size=4,
                        dtype=torch.float32, seed=seed, num_splits=2, kv_names=kv_names)
        _attention_case([3, 1, 18, 5], [7, 6, 22, 13], hkv=1, group=2, d=64, page_size=4,
                        dtype=torch.float32, seed=seed + 1, kv_names=kv_names)
        _attention_case([2, 1], [11, 5], hkv=2, group=2, d=64, page_size=4, dtype=torch.bfloat16,
                        seed=seed + 2, kv_names=kv_names)
        _attention_case([4, 1], [10, 9], hkv=1, group=2, d=96, page_size=4, dtype=torch.float32,
                        seed=seed + 3, window=5, softcap=2.0, kv_names=kv_names)
    # the public functions with the Triton path forced hand the scales to the kernels
    import kernels

    g = torch.Generator(DEVICE).manual_seed(70)
    k, v, q = (torch.randn(8, 1, 32, generator=g) for _ in range(3))
    (kc, ks), (vc, vs) = (_quantized_cache(name, 1, 2, 4, 32, g) for name in ("q8", "q4"))  # k8v4
    caches = [t.clone() for t in (kc, vc, ks, vs)]
    cu, ctx, table = (torch.tensor(x, dtype=torch.int32) for x in ([0, 8], [8], [[1, 0]]))
    ref.write_kv(k, v, kc, vc, torch.arange(8), ks, vs)
    os.environ[kernels.FORCE_ENV] = "1"
    try:
        kernels.write_kv(k, v, caches[0], caches[1], torch.arange(8), caches[2], caches[3])
        got = kernels.paged_attention(q, *caches[:2], table, cu, ctx, 0.2, None, None, *caches[2:])
    finally:
        del os.environ[kernels.FORCE_ENV]
    assert kernels.triton_module(q, "triton_kernels") is tk
    assert all(_same_bits(a, b) for a, b in zip(caches, (kc, vc, ks, vs))), "forced write_kv differs"
    close("public paged_attention k8v4, Triton forced", got,
          ref.paged_attention(q, kc, vc, table, cu, ctx, 0.2, None, None, ks, vs), torch.float32)


def _greedy_run(model_dir: str, forced: bool) -> dict[str, list[int]]:
    """Greedy completions of a batch with chunked prefill, decodes in the same
    steps and a prefix-cache hit, with the Triton path forced or not."""
    from engine import Generator, Job, SamplerSettings

    os.environ["GENQ_FORCE_TRITON"] = "1" if forced else "0"
    try:
        gen = Generator.from_pretrained(model_dir, cache_tokens=256, page_size=8, max_chunk_size=12, max_batch_size=4)
        base = list(range(40, 60))
        prompts = {"a": base, "b": [7, 8, 9], "c": base[:16] + [99, 98, 97]}  # c shares a's first two pages
        greedy = SamplerSettings(temperature=0.0)
        out: dict[str, list[int]] = {}
        gen.enqueue(Job(prompts["a"], 4, stop_conditions=[], gen_settings=greedy, identifier="a"))
        gen.enqueue(Job(prompts["b"], 6, stop_conditions=[], gen_settings=greedy, identifier="b"))
        steps = 0
        cached = 0
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                out.setdefault(r["identifier"], []).extend(r["token_ids"])
                if r["eos"]:
                    cached += r["cached_tokens"]
                    if r["identifier"] == "a":  # enqueued after a's pages are cached
                        gen.enqueue(Job(prompts["c"], 3, stop_conditions=[], gen_settings=greedy, identifier="c"))
            steps += 1
        assert cached >= 16, f"expected a prefix-cache hit, got {cached} cached tokens"
        return out
    finally:
        os.environ.pop("GENQ_FORCE_TRITON", None)


def check_lora() -> None:
    """The grouped LoRA product (kernels/lora.py): a shuffled subset of a batch's rows gathered,
    through A and B, added to out in place; rows outside the group unchanged bit for bit. bf16 is
    compared with the reference computed in fp32 and rounded once, as the kernel rounds."""
    from kernels import lora as lora_ref
    from kernels import triton_lora as tl_lora

    g = torch.Generator(DEVICE).manual_seed(9)
    for dtype in DTYPES:
        for t, k, r, n, group in ((7, 96, 8, 80, 4), (20, 64, 24, 160, 17), (3, 48, 192, 40, 3), (5, 64, 16, 64, 0)):
            x = torch.randn(t, k, generator=g).to(dtype)
            a = (0.1 * torch.randn(r, k, generator=g)).to(dtype)
            b = (0.1 * torch.randn(n, r, generator=g)).to(dtype)
            out = torch.randn(t, n, generator=g).to(dtype)
            tokens = torch.randperm(t, generator=g)[:group]
            got = out.clone()
            tl_lora.lora_add(got, x, a, b, tokens)
            want = out.float()
            lora_ref.lora_add_reference(want, x.float(), a.float(), b.float(), tokens)
            close(f"lora_add {dtype} T={t} K={k} R={r} N={n} G={group}", got, want.to(dtype), dtype)
            untouched = torch.ones(t, dtype=torch.bool)
            untouched[tokens] = False
            assert torch.equal(got[untouched], out[untouched]), "lora_add wrote rows outside its group"


def check_engine() -> None:
    """The whole engine's greedy tokens, Triton (interpreter) vs the torch reference:
    llama and qwen3 (tiny model maker), and Gemma 2 (transformers-initialised:
    soft-capped attention, sliding and global layers, (1 + weight) norms, gelu-tanh)."""
    import tempfile
    from pathlib import Path

    from genq_dev.tiny_model import make_tiny_model
    from tests.conftest import make_hf_model
    from tests.test_engine_vs_transformers import VARIANTS

    gemma2 = next(v for v in VARIANTS if v.name == "gemma2")
    calls: dict[str, int] = {}
    shapes: set[str] = set()  # kinds of attention batch seen: decode-only, prefill-only, mixed
    for name in ("rms_norm", "apply_rope", "silu_and_mul", "gelu_tanh_and_mul", "write_kv", "paged_attention"):
        original = getattr(tk, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            if _name == "paged_attention":
                q_lens = set(args[4].diff().tolist())
                shapes.add("mixed" if 1 in q_lens and len(q_lens) > 1 else "decode" if q_lens == {1} else "prefill")
            return _original(*args, **kwargs)

        setattr(tk, name, counted)
    with tempfile.TemporaryDirectory() as tmp:
        for family in ("llama", "qwen3", "gemma2"):
            if family == "gemma2":
                model_dir = str(make_hf_model(Path(tmp, family), gemma2.config_class, **gemma2.overrides))
            else:
                model_dir = str(make_tiny_model(os.path.join(tmp, family), family=family))
            want = _greedy_run(model_dir, forced=False)
            assert not calls, f"the reference run reached Triton: {calls}"
            got = _greedy_run(model_dir, forced=True)
            activation = "gelu_tanh_and_mul" if family == "gemma2" else "silu_and_mul"
            assert set(calls) == {"rms_norm", "apply_rope", activation, "write_kv", "paged_attention"}, calls
            print(f"engine {family}: {want} kernel calls {calls}")
            assert got == want, f"{family}: triton {got} != reference {want}"
            assert shapes == {"mixed", "decode", "prefill"}, shapes
            calls.clear()
            shapes.clear()


def check_lora_engine() -> None:
    """The engine's greedy tokens for a batch mixing a PEFT adapter and the base model, Triton
    (interpreter) vs the torch reference: the LoRA kernels run inside the model's linears."""
    import tempfile
    from pathlib import Path

    from engine import Generator, Job
    from genq_dev.tiny_model import make_tiny_model
    from kernels import triton_lora
    from tests.lora_adapters import save_peft_adapter

    calls = []
    original = triton_lora.lora_add

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    triton_lora.lora_add = counted
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_model(Path(tmp, "llama"), family="llama")
        adapter = save_peft_adapter(model_dir, Path(tmp, "adapter"), 0, r=8, lora_alpha=16,
                                    target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
        runs = []
        for forced in (False, True):
            os.environ["GENQ_FORCE_TRITON"] = "1" if forced else "0"
            gen = Generator.from_pretrained(model_dir, cache_tokens=256, page_size=8, max_chunk_size=12)
            gen.adapters.register("tuned", adapter)
            jobs = [Job(list(range(40, 40 + n)), 4, stop_conditions=[], identifier=i, adapter=name)
                    for i, (n, name) in enumerate(((9, "tuned"), (3, None), (14, "tuned")))]
            for job in jobs:
                gen.enqueue(job)
            out: dict[int, list[int]] = {}
            while gen.num_remaining_jobs():
                for r in gen.iterate():
                    out.setdefault(r["identifier"], []).extend(r["token_ids"])
            runs.append(out)
            assert bool(calls) == forced, f"forced={forced}: {len(calls)} Triton LoRA calls"
        os.environ["GENQ_FORCE_TRITON"] = "0"
    print(f"engine with an adapter: {runs[0]} ({len(calls)} Triton LoRA calls)")
    assert runs[1] == runs[0], f"triton {runs[1]} != reference {runs[0]}"


GROUPS = {
    "rms_norm": check_rms_norm,
    "silu_and_mul": check_silu_and_mul,
    "gelu_tanh_and_mul": check_gelu_tanh_and_mul,
    "apply_rope": check_apply_rope,
    "write_kv": check_write_kv,
    "attention_decode": check_attention_decode,
    "attention_prefill": check_attention_prefill,
    "engine": check_engine,
    "lora": check_lora,
    "lora_engine": check_lora_engine,
    "fp8_codec": check_fp8_codec,
    "kv_quant_write": check_kv_quant_write,
    "kv_quant_attention": check_kv_quant_attention,
}

if __name__ == "__main__":
    for name in sys.argv[1:] or list(GROUPS):
        GROUPS[name]()
