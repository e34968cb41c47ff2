"""Compile the verification kernels for a GPU target on a machine without a GPU.

Triton can lower a kernel to PTX and run its bundled ``ptxas`` without a
device, so this script catches GPU-only compile errors (which the CPU
interpreter cannot) and reports registers / spills / shared memory per
kernel and config, from ``ptxas -v``. It does not time anything.

Usage (TRITON_INTERPRET must be unset):

    python benchmarks/compile_check.py [--arch 90] [--sweep] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def _ptxas_report(ptx: str, arch: str) -> dict:
    from triton.backends.nvidia import compiler as nvc

    ptxas = nvc.get_ptxas(arch=int(re.sub(r"\D", "", arch))).path if hasattr(nvc, "get_ptxas") else "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
        path = f.name
    try:
        gpu = f"sm_{arch}"
        out = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu}", path, "-o", os.devnull], capture_output=True, text=True, check=False
        )
    finally:
        os.unlink(path)
    text = out.stdout + out.stderr
    rep: dict = {"ptxas_rc": out.returncode}
    m = re.search(r"Used (\d+) registers", text)
    rep["registers"] = int(m.group(1)) if m else None
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    rep["spill_stores"], rep["spill_loads"] = (int(m.group(1)), int(m.group(2))) if m else (None, None)
    m = re.search(r"(\d+) bytes stack frame", text)
    rep["stack_frame"] = int(m.group(1)) if m else None
    if out.returncode:
        rep["ptxas_error"] = text[-2000:]
    return rep


def _compile(fn, signature: dict, constexprs: dict, div16: list[str], arch: int, num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {}
    for name in names:
        sig[name] = "constexpr" if name in constexprs else signature[name]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    backend = triton.compiler.make_backend(target)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages})
    return triton.compile(src, target=target, options=options.__dict__)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    ap.add_argument("--sweep", action="store_true", help="compile every sweep config, not only the defaults")
    ap.add_argument("--json", default=None, help="write the report as JSON here")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")
        return 2
    import torch  # noqa: F401
    from spec_rl.kernels import configs
    from spec_rl.kernels.from_logits import verify_from_logits_kernel
    from spec_rl.kernels.lm_head import lm_head_merge_kernel, lm_head_partial_kernel

    arch = args.arch
    ptx_arch = f"{arch}a" if arch >= 90 else str(arch)
    results = []

    logits_cfgs = (
        configs.LOGITS_SWEEP
        if args.sweep
        else [configs.LogitsConfig(4096, 8), configs.LogitsConfig(2048, 8), configs.LogitsConfig(1024, 4, block_r=4)]
    )
    for dtype in ("bf16", "fp32"):
        for cfg in logits_cfgs:
            for packed in (True, False):
                for mode in (0, 3):
                    sig = {
                        "logits_ptr": f"*{dtype}",
                        "ids_ptr": "*i64",
                        "old_ptr": "*fp32",
                        "lp_out_ptr": "*fp32",
                        "acc_out_ptr": "*i8",
                        "n_ptr": "*i32",
                        "flag_ptr": "*i32",
                        "row_sample_ptr": "*i32",
                        "row_token_ptr": "*i32",
                        "lengths_ptr": "*i64",
                        "uids_ptr": "*i64",
                        "n_rows": "i32",
                        "V": "i32",
                        "T": "i32",
                        "stride_b": "i32",
                        "stride_t": "i32",
                        "k0_w": "i32",
                        "k1_w": "i32",
                        "log_l_lo": "i32",
                        "log_l_hi": "i32",
                        "temp_lo": "i32",
                        "temp_hi": "i32",
                        "c_exp2": "fp32",
                    }
                    const = {
                        "PACKED": packed,
                        "MODE": mode,
                        "BLOCK_R": cfg.block_r,
                        "BLOCK_V": cfg.block_v,
                        "USE_LIBDEVICE": True,
                    }
                    div = [k for k, v in sig.items() if v.startswith("*")] + ["V", "T", "stride_b", "stride_t"]
                    name = (
                        f"from_logits {dtype} packed={packed} mode={mode} BLOCK_R={cfg.block_r} BLOCK_V={cfg.block_v} "
                        f"warps={cfg.num_warps}"
                    )
                    results.append(
                        _run(name, verify_from_logits_kernel, sig, const, div, arch, ptx_arch, cfg.num_warps, 1)
                    )

    lm_variants = [
        ("bf16", cfg, False, False, True)
        for cfg in (configs.LM_HEAD_SWEEP if args.sweep else [configs.LM_HEAD_SWEEP[0]])
    ]
    # fp16 + bias + ragged d; fp32 (IEEE dot) with the default fp32 config.
    lm_variants.append(("fp16", configs.LM_HEAD_SWEEP[0], True, False, False))
    lm_variants.append(("fp32", configs.LMHeadConfig(64, 64, 32, 4, 3), True, True, False))
    for dtype, cfg, has_bias, dot_fp32, even_k in lm_variants:
        for row_map in (False, True):
            sig = {
                "h_ptr": f"*{dtype}",
                "w_ptr": f"*{dtype}",
                "bias_ptr": "*fp32",
                "ids_ptr": "*i64",
                "row_off_ptr": "*i64",
                "part_m_ptr": "*fp32",
                "part_s_ptr": "*fp32",
                "tgt_ptr": "*fp32",
                "N": "i32",
                "V": "i32",
                "D": "i32",
                "stride_h": "i32",
                "stride_w": "i32",
                "n_vtiles": "i32",
                "tiles_per_split": "i32",
                "num_splits": "i32",
                "c_exp2": "fp32",
            }
            const = {
                "HAS_BIAS": has_bias,
                "HAS_ROW_MAP": row_map,
                "ROW_ALIGN": 8,
                "EVEN_K": even_k,
                "DOT_FP32": dot_fp32,
                "BLOCK_M": cfg.block_m,
                "BLOCK_N": cfg.block_n,
                "BLOCK_K": cfg.block_k,
                "FLATTEN": cfg.flatten,
            }
            div = [k for k, v in sig.items() if v.startswith("*")] + ["V", "D", "stride_h", "stride_w"]
            name = (
                f"lm_head_partial {dtype} bias={has_bias} even_k={even_k} row_map={row_map} "
                f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
                f"splits~{cfg.target_splits}" + (" flatten" if cfg.flatten else "")
            )
            results.append(
                _run(name, lm_head_partial_kernel, sig, const, div, arch, ptx_arch, cfg.num_warps, cfg.num_stages)
            )
    sig = {
        "part_m_ptr": "*fp32",
        "part_s_ptr": "*fp32",
        "tgt_ptr": "*fp32",
        "old_ptr": "*fp32",
        "lp_out_ptr": "*fp32",
        "acc_out_ptr": "*i8",
        "n_ptr": "*i32",
        "flag_ptr": "*i32",
        "row_sample_ptr": "*i32",
        "row_token_ptr": "*i32",
        "uids_ptr": "*i64",
        "N": "i32",
        "num_splits": "i32",
        "k0_w": "i32",
        "k1_w": "i32",
        "log_l_lo": "i32",
        "log_l_hi": "i32",
        "temp_lo": "i32",
        "temp_hi": "i32",
        "c_exp2": "fp32",
    }
    for mode in (0, 1, 2, 3):
        const = {"MODE": mode, "BLOCK": 256, "USE_LIBDEVICE": True}
        div = [k for k, v in sig.items() if v.startswith("*")] + ["N"]
        results.append(_run(f"lm_head_merge mode={mode}", lm_head_merge_kernel, sig, const, div, arch, ptx_arch, 4, 1))

    from spec_rl.kernels.philox import _philox_uniform_kernel, _philox_words_kernel

    sig = {
        "out_ptr": "*fp32",
        "uids_ptr": "*i64",
        "tokens_ptr": "*i32",
        "n": "i32",
        "k0_w": "i32",
        "k1_w": "i32",
        "stream_w": "i32",
    }
    results.append(_run("philox_uniform", _philox_uniform_kernel, sig, {"BLOCK": 256}, [], arch, ptx_arch, 4, 1))
    sig = {"out_ptr": "*i64", "in_ptr": "*i64", "n": "i32"}
    results.append(_run("philox_words", _philox_words_kernel, sig, {"BLOCK": 64}, [], arch, ptx_arch, 4, 1))

    # Paged decode attention (issue 4): variants listed next to its benchmark.
    from bench_paged_attention import compile_variants

    for name, fn, sig, const, div, warps, stages in compile_variants(sweep=args.sweep):
        results.append(_run(name, fn, sig, const, div, arch, ptx_arch, warps, stages))

    width = max(len(r["kernel"]) for r in results)
    print(f"{'kernel':<{width}}  status  regs  spill_st  spill_ld  smem_bytes  wgmma  v4_loads")
    ok = True
    for r in results:
        status = "ok" if r.get("error") is None and r.get("ptxas_rc", 0) == 0 else "FAIL"
        if r["kernel"].startswith("from_logits") and not r.get("vector_loads"):
            status = "FAIL"  # the logits stream must be read with 16-byte vector loads
        ok &= status == "ok"
        print(
            f"{r['kernel']:<{width}}  {status:<6}  {r.get('registers')!s:>4}  {r.get('spill_stores')!s:>8}  "
            f"{r.get('spill_loads')!s:>8}  {r.get('shared')!s:>10}  {r.get('uses_wgmma')!s:>5}  "
            f"{r.get('vector_loads')!s:>8}"
        )
        if r.get("error"):
            print("    " + r["error"].replace("\n", "\n    ")[:3000])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arch": arch, "results": results}, f, indent=2)
    return 0 if ok else 1


def _run(name, fn, sig, const, div, arch, ptx_arch, num_warps, num_stages) -> dict:
    rec: dict = {"kernel": name}
    try:
        cc = _compile(fn, sig, const, div, arch, num_warps, num_stages)
        rec["shared"] = getattr(cc.metadata, "shared", None)
        rec.update(_ptxas_report(cc.asm["ptx"], ptx_arch))
        ptx = cc.asm.get("ptx", "")
        rec["uses_wgmma"] = "wgmma.mma_async" in ptx
        # 16-byte vector loads from global memory (the from-logits stream must use them).
        rec["vector_loads"] = len(re.findall(r"ld\.global[^\n;]*\.v4\.", ptx))
        rec["scalar_16bit_loads"] = len(re.findall(r"ld\.global[^\n;]*\.b16", ptx))
    except Exception as exc:  # report and continue
        rec["error"] = f"{type(exc).__name__}: {exc}"
    return rec


if __name__ == "__main__":
    sys.exit(main())
