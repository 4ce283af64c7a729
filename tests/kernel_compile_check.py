"""Compile every Triton kernel ahead of time for an NVIDIA sm_90 (H100) target,
without a GPU: the interpreter runs kernels as numpy and so does not catch
what only the compiler rejects (loop-carried type changes, dot shapes,
constexpr misuse). Run by tests/test_kernels.py in its own process, with
TRITON_INTERPRET unset. Prints one line per kernel configuration.

    python tests/kernel_compile_check.py [bf16|fp32 ...]
"""

from __future__ import annotations

import os
import sys

assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0"), "compile checks need TRITON_INTERPRET unset"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kernels import triton_kernels as tk  # noqa: E402
from kernels import triton_lora  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def compile_one(name: str, fn, signature: dict[str, str], constexprs: dict[str, object]) -> None:
    signature = {**signature, **{c: "constexpr" for c in constexprs}}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET)
    assert kernel.asm.get("cubin"), f"{name}: no cubin"
    print(f"{name}: compiled for sm_90")


def check(dt: str) -> None:
    p = "*" + dt
    for unit_offset in (False, True):
        compile_one(f"rms_norm {dt} unit_offset={unit_offset}", tk._rms_norm_kernel, {
            "x_ptr": p, "res_ptr": p, "w_ptr": p, "out_ptr": p, "res_out_ptr": p, "stride_x": "i32",
            "stride_res": "i32", "stride_out": "i32", "stride_res_out": "i32", "n_cols": "i32", "eps": "fp32"},
            {"HAS_RESIDUAL": True, "UNIT_OFFSET": unit_offset, "BLOCK": 4096})
    for gelu in (False, True):
        compile_one(f"{'gelu_tanh' if gelu else 'silu'}_and_mul {dt}", tk._act_and_mul_kernel, {
            "x_ptr": p, "out_ptr": p, "stride_x": "i32", "stride_out": "i32", "n_cols": "i32"},
            {"GELU_TANH": gelu, "BLOCK": 1024})
    compile_one(f"apply_rope {dt}", tk._rope_kernel, {
        "x_ptr": p, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "stride_xt": "i32", "stride_xh": "i32", "stride_ct": "i32",
        "stride_st": "i32", "num_heads": "i32", "half": "i32"}, {"BLOCK_H": 32, "BLOCK_HALF": 64})
    compile_one(f"write_kv {dt}", tk._write_kv_kernel, {
        "k_ptr": p, "v_ptr": p, "k_cache_ptr": p, "v_cache_ptr": p, "slot_ptr": "*i64", "stride_kt": "i32",
        "stride_kh": "i32", "stride_vt": "i32", "stride_vh": "i32", "stride_kc_h": "i64", "stride_kc_s": "i32",
        "stride_vc_h": "i64", "stride_vc_s": "i32", "head_dim": "i32"}, {"BLOCK_D": 128})
    names = ["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "part_out_ptr", "part_lse_ptr", "page_table_ptr",
             "cu_q_ptr", "ctx_ptr", "scale", "num_seqs", "num_query_heads", "head_dim", "sliding_window", "softcap",
             "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kc_h", "stride_kc_p", "stride_kc_s",
             "stride_vc_h", "stride_vc_p", "stride_vc_s", "stride_pt", "page_size", "k_scale_ptr", "v_scale_ptr",
             "stride_ks_h", "stride_ks_p", "stride_ks_s", "stride_vs_h", "stride_vs_p", "stride_vs_s"]
    # a float cache (format "auto"): the scale pointers and strides are passed but never read
    types = [p, p, p, p, "*fp32", "*fp32", "*i32", "*i32", "*i32", "fp32"] + ["i32"] * 4 + ["fp32"] + ["i32"] * 12
    types += [p, p] + ["i32"] * 6
    auto = tk._FORMAT_IDS["auto"]
    for decode, splits, window, group, softcap in (
        (True, 8, False, 4, True), (False, 1, True, 8, True), (False, 2, False, 1, False)
    ):
        block_m = 16 if decode else 64
        consts = dict(GROUP=group, GROUP_PAD=group, BLOCK_Q=1 if decode else block_m // group, BLOCK_M=block_m,
                      BLOCK_N=64, BLOCK_D=128, NUM_SPLITS=splits, DECODE_ONLY=decode, HAS_WINDOW=window,
                      SOFTCAP=softcap, IEEE=dt == "fp32", K_FORMAT=auto, K_GROUP=128, V_FORMAT=auto,
                      V_GROUP=128)
        compile_one(f"paged_attention {dt} decode_only={decode} splits={splits} window={window} G={group} "
                    f"softcap={softcap}",
                    tk._paged_attention_kernel, dict(zip(names, types)), consts)
    compile_one(f"merge_splits {dt}", tk._merge_splits_kernel, {
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": p, "num_query_heads": "i32", "head_dim": "i32",
        "stride_ot": "i32", "stride_oh": "i32"}, {"NUM_SPLITS": 8, "BLOCK_S": 8, "BLOCK_D": 128})
    blocks = {"BLOCK_M": triton_lora.BLOCK_M, "BLOCK_R": triton_lora.BLOCK_R}
    compile_one(f"lora shrink {dt}", triton_lora._shrink_kernel, {
        "x_ptr": p, "a_ptr": p, "tok_ptr": "*i64", "tmp_ptr": "*fp32", "G": "i32", "K": "i32", "R": "i32",
        "stride_x": "i32", "stride_a": "i32", "stride_t": "i32"},
        {"IEEE": dt == "fp32", **blocks, "BLOCK_K": triton_lora.BLOCK_K})
    compile_one(f"lora expand {dt}", triton_lora._expand_kernel, {
        "tmp_ptr": "*fp32", "b_ptr": p, "tok_ptr": "*i64", "out_ptr": p, "G": "i32", "R": "i32", "N": "i32",
        "stride_t": "i32", "stride_b": "i32", "stride_o": "i32"}, {**blocks, "BLOCK_N": triton_lora.BLOCK_N})


if __name__ == "__main__":
    for dt in sys.argv[1:] or ["bf16"]:
        check(dt)
