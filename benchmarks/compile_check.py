"""Stage 7 of the GPU check: compile the Triton kernels for a GPU target, on a machine that needs no GPU.

    python benchmarks/compile_check.py [--arch 90] [--sweep | --defaults-only] [--jobs 8] [--json PATH]

Triton lowers a kernel to PTX and runs its bundled ``ptxas`` without a device, so this catches GPU-only compile
errors (which the interpreter cannot) and reports registers / spills / shared memory per kernel and config from
``ptxas -v``; it times nothing. Each :class:`Variant` is one specialisation: argument types, constexprs, the
arguments promised to be multiples of 16 (what the launchers' alignment lets Triton assume), warps / stages,
following the launchers in spec_rl.kernels: the default configs at the shapes the package meets, every sweep
config with ``--sweep``, only the configs picked at the Qwen3 shapes with ``--defaults-only`` (stage 7). Exit 1 when
a kernel fails to compile or assemble, or the from-logits stream lacks 16-byte vector loads. TRITON_INTERPRET must
be unset.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, NamedTuple

import _harness as H  # benchmarks/ is on sys.path when a script here runs
import torch


class Variant(NamedTuple):
    name: str
    kernel: Any  # a triton.JITFunction
    signature: dict
    constexprs: dict
    div16: list
    num_warps: int
    num_stages: int


def _sig(kernel, **types: str) -> dict:
    """The argument types of ``kernel``: ``types``, else "*fp32" for a ``*_ptr``, else "i32" (constexprs are typed
    by :func:`_compile`)."""
    return {n: types.get(n, "*fp32" if n.endswith("_ptr") else "i32") for n in kernel.arg_names}


def _pointers(signature: dict, *more: str) -> list[str]:
    """Every pointer argument (the launchers pass 16-byte aligned tensors) plus ``more``."""
    return [k for k, v in signature.items() if v.startswith("*")] + list(more)


def from_logits_variants(sweep: bool) -> list[Variant]:
    from spec_rl.kernels import configs
    from spec_rl.kernels.from_logits import verify_from_logits_kernel

    cfgs = (
        H.kernel_sweeps()["logits"]
        if sweep
        else [configs.LogitsConfig(4096, 8), configs.LogitsConfig(2048, 8), configs.LogitsConfig(1024, 4, block_r=4)]
    )
    out = []
    for dtype in ("bf16", "fp32"):
        ptr = dict(ids_ptr="*i64", row_sample_ptr="*i32", params_ptr="*i32")
        sig = _sig(verify_from_logits_kernel, logits_ptr=f"*{dtype}", **ptr)
        div = _pointers(sig, "V", "T", "stride_b", "stride_t")
        for cfg in cfgs:
            for packed in (True, False):
                const = dict(PACKED=packed, BLOCK_R=cfg.block_r, BLOCK_V=cfg.block_v)
                name = (
                    f"from_logits {dtype} packed={packed} BLOCK_R={cfg.block_r} BLOCK_V={cfg.block_v} w{cfg.num_warps}"
                )
                out.append(Variant(name, verify_from_logits_kernel, sig, const, div, cfg.num_warps, 1))
    return out


def lm_head_variants(sweep: bool) -> list[Variant]:
    from spec_rl.kernels import configs
    from spec_rl.kernels.lm_head import lm_head_partial_kernel

    bf16_cfgs = H.kernel_sweeps()["lm_head"] if sweep else H.kernel_sweeps()["lm_head"][:1]
    todo = [("bf16", cfg, False, False, True) for cfg in bf16_cfgs]
    # fp16 + bias + ragged d; fp32 (IEEE dot) with the default fp32 config.
    todo.append(("fp16", H.kernel_sweeps()["lm_head"][0], True, False, False))
    todo.append(("fp32", configs.LMHeadConfig(64, 64, 32, 4, 3), True, True, False))
    out = []
    for dtype, cfg, has_bias, dot_fp32, even_k in todo:
        ptr = dict(ids_ptr="*i64", row_off_ptr="*i64", params_ptr="*i32")
        sig = _sig(lm_head_partial_kernel, h_ptr=f"*{dtype}", w_ptr=f"*{dtype}", **ptr)
        for row_map in (False, True):
            const = dict(
                HAS_BIAS=has_bias,
                HAS_ROW_MAP=row_map,
                ROW_ALIGN=8,
                EVEN_K=even_k,
                DOT_FP32=dot_fp32,
                BLOCK_M=cfg.block_m,
                BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k,
                FLATTEN=cfg.flatten,
            )
            name = (
                f"lm_head_partial {dtype} bias={has_bias} even_k={even_k} row_map={row_map} "
                f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
                f"splits~{cfg.target_splits}" + (" flatten" if cfg.flatten else "")
            )
            div = _pointers(sig, "V", "D", "stride_h", "stride_w")
            out.append(Variant(name, lm_head_partial_kernel, sig, const, div, cfg.num_warps, cfg.num_stages))
    return out


def epilogue_variants() -> list[Variant]:
    from spec_rl.kernels.epilogue import EPILOGUE_BLOCK, epilogue_kernel

    ints = dict.fromkeys(("n_ptr", "flag_ptr", "row_sample_ptr", "row_token_ptr", "params_ptr"), "*i32")
    sig = _sig(epilogue_kernel, acc_out_ptr="*i8", uids_ptr="*i64", **ints)
    const = {"BLOCK": EPILOGUE_BLOCK, "USE_LIBDEVICE": True}
    return [
        Variant(f"epilogue mode={mode}", epilogue_kernel, sig, {"MODE": mode, **const}, _pointers(sig, "N"), 4, 1)
        for mode in (0, 1, 2, 3)
    ]


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def paged_attention_variants(sweep: bool) -> list[Variant]:
    """Paged decode attention at the engine's shapes, split and not, and the merge kernel.

    Defaults (``default_paged_attention_config``) for Qwen3 (G=2, D=128), Llama-3-8B (G=4,
    D=128), G=8, D=64 and D=256, fp16, the fp32 broadcast path and the tiny
    test models' D=8; ``sweep`` adds every ``SWEEP`` config at the Qwen3 shape.
    """
    from spec_rl.kernels import configs as C
    from spec_rl.kernels import paged_attention as PA

    shapes = [(2, 128, torch.bfloat16), (4, 128, torch.bfloat16), (8, 128, torch.bfloat16), (2, 64, torch.bfloat16)]
    shapes += [(2, 256, torch.bfloat16), (2, 128, torch.float16), (2, 128, torch.float32), (2, 8, torch.float32)]
    todo = [
        (g, d, dt, C.default_paged_attention_config(g, d, dt), split) for g, d, dt in shapes for split in (False, True)
    ]
    if sweep:
        todo += [(2, 128, torch.bfloat16, c, False) for c in H.kernel_sweeps()["paged_attention"]]
    out = []
    for g, d, dt, cfg, split in todo:
        d_pad = C.next_pow2(max(d, 8))
        use_dot = cfg.use_dot and d_pad >= 16
        const = dict(
            G=g,
            G_PAD=max(16, C.next_pow2(g)) if use_dot else C.next_pow2(g),
            D=d,
            D_PAD=d_pad,
            BLOCK_SIZE=16,
            BLOCK_N=cfg.block_n,
            USE_DOT=use_dot,
            DOT_F32=dt == torch.float32,
            SPLIT=split,
        )
        dt_name = _DTYPE_NAMES[dt]
        ptr = dict(q_ptr=f"*{dt_name}", kv_ptr=f"*{dt_name}", out_ptr=f"*{dt_name}", bt_ptr="*i32")
        sig = _sig(PA.paged_decode_kernel, seq_lens_ptr="*i32", qk_scale="fp32", **ptr)
        div = _pointers(sig, "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_blk", "stride_kv")
        div += ["stride_tok", "stride_head"] if d % 16 == 0 else []
        name = (
            f"paged_decode {_DTYPE_NAMES[dt]} G={g} D={d} split={split} BLOCK_N={cfg.block_n} "
            f"{'dot' if use_dot else 'bcast'} w{cfg.num_warps} s{cfg.num_stages}"
        )
        out.append(Variant(name, PA.paged_decode_kernel, sig, const, div, cfg.num_warps, cfg.num_stages))
    msig = _sig(PA.paged_decode_merge_kernel, out_ptr="*bf16")
    mdiv = ["part_acc_ptr", "part_ml_ptr", "out_ptr", "stride_ob", "stride_oh"]
    out.append(
        Variant(
            "paged_decode_merge bf16 D=128", PA.paged_decode_merge_kernel, msig, {"D": 128, "D_PAD": 128}, mdiv, 2, 1
        )
    )
    return out


def all_variants(sweep: bool) -> list[Variant]:
    """Every variant, in the order they are reported."""
    return from_logits_variants(sweep) + lm_head_variants(sweep) + epilogue_variants() + paged_attention_variants(sweep)


def default_variants() -> list[Variant]:
    """Only the configs the package picks on an H100/H200 at the Qwen3 shapes (bf16, V = 151936, G = 2, D = 128).

    From-logits: ``default_logits_config``, packed and padded; fused LM head: the sm_90 default of
    ``default_lm_head_config`` (``LM_HEAD_SWEEP[0]``) with and without a row map; the epilogue in every
    rule mode; paged decode: ``default_paged_attention_config``, split and not, and its merge. 11 variants
    (the GPU check's compile stage).
    """
    from spec_rl.kernels import configs

    lg = configs.default_logits_config(151936, torch.bfloat16, interpret=False)
    lm = H.kernel_sweeps()["lm_head"][0]
    pa = configs.default_paged_attention_config(2, 128, torch.bfloat16)

    def keep(v: Variant) -> bool:
        c, first = v.constexprs, next(iter(v.signature.values()))
        kind = v.name.split()[0]
        if kind == "from_logits":
            return first == "*bf16" and (c["BLOCK_V"], c["BLOCK_R"], v.num_warps) == (
                lg.block_v,
                lg.block_r,
                lg.num_warps,
            )
        if kind == "lm_head_partial":
            return first == "*bf16" and (c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) == (
                lm.block_m,
                lm.block_n,
                lm.block_k,
            )
        if kind == "paged_decode":
            return first == "*bf16" and (c["G"], c["D"], c["BLOCK_N"]) == (2, 128, pa.block_n)
        return kind in ("epilogue", "paged_decode_merge")

    return [v for v in all_variants(False) if keep(v)]


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


def _status(rec: dict) -> str:
    if rec.get("error") is not None or rec.get("ptxas_rc", 0) != 0:
        return "FAIL"
    if rec["kernel"].startswith("from_logits") and not rec.get("vector_loads"):
        return "FAIL"  # the logits stream must be read with 16-byte vector loads
    return "ok"


def report(rec: dict) -> list[str]:
    """Registers / spills / shared memory per kernel from ptxas."""
    columns = [("kernel", "kernel", "{}"), ("status", _status, "{}"), ("registers", "registers", "{}")]
    columns += [(k.replace("_", " "), k, "{}") for k in ("spill_stores", "spill_loads")]
    columns += [("shared bytes", "shared", "{}"), ("wgmma", "uses_wgmma", "{}"), ("v4 loads", "vector_loads", "{}")]
    head = f"sm_{rec.get('arch')}, triton {rec['provenance'].get('triton')} (its own ptxas)."
    body = [head, ""] + H.rows_table(columns, rec["results"])
    return H.section("Compile check (stage 7, compile_check.py)", rec, body)


_JOBS: list = []  # (variant, arch, ptx arch) of this run, inherited by the forked workers


def _run_index(i: int) -> dict:
    return _run(*_JOBS[i])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    which = ap.add_mutually_exclusive_group()
    which.add_argument("--sweep", action="store_true", help="compile every sweep config, not only the defaults")
    which.add_argument(
        "--defaults-only",
        action="store_true",
        help="only the configs the package picks at the Qwen3 shapes (default_variants)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many forked processes")
    ap.add_argument("--json", default=None, help="write the report as JSON here (rewritten after every kernel)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")
        return 2
    arch = args.arch
    ptx_arch = f"{arch}a" if arch >= 90 else str(arch)
    variants = default_variants() if args.defaults_only else all_variants(args.sweep)
    _JOBS[:] = [(v, arch, ptx_arch) for v in variants]
    print(f"compile_check: {len(variants)} kernel variants for sm_{arch}, {args.jobs} job(s)", flush=True)
    rec = H.RunRecord(args.json, {"arch": arch, "provenance": H.provenance("cpu"), "results": []}, report)
    pool = multiprocessing.get_context("fork").Pool(args.jobs) if args.jobs > 1 else None
    try:
        results = pool.imap(_run_index, range(len(variants))) if pool else map(_run_index, range(len(variants)))
        for r in results:
            rec.record["results"].append(r)
            print(f"  {_status(r):<4} {r['kernel']}: registers {r.get('registers')}, spills {r.get('spill_stores')}")
            if _status(r) != "ok":
                why = r.get("error") or r.get("ptxas_error") or "no 16-byte vector loads"
                rec.fail(f"{r['kernel']}: {why[:300]}")
            rec.save()
    finally:
        if pool is not None:
            pool.close()
    return rec.finish()


def _run(v, arch: int, ptx_arch: str) -> dict:
    """Compile one :class:`Variant`; its ptxas numbers, or ``error``."""
    rec: dict = {"kernel": v.name}
    try:
        cc = _compile(v.kernel, v.signature, v.constexprs, v.div16, arch, v.num_warps, v.num_stages)
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
