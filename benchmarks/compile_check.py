"""Stage 7 of the GPU check (docs/gpu-check.md): compile the Triton kernels for sm_90 without a GPU.

Triton lowers a kernel to PTX and runs its bundled ``ptxas``, so this catches GPU-only compile errors (which the
interpreter cannot) and reports registers / spills / shared memory per kernel from ``ptxas -v``. Each
:class:`Variant` is one specialisation as the launchers in spec_rl.kernels make it: argument types, constexprs, the
arguments promised to be multiples of 16, warps / stages. Exit 1 when a kernel fails to compile or assemble, or the
from-logits stream lacks 16-byte vector loads. TRITON_INTERPRET must be unset.
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

ARCH, PTX_ARCH = 90, "90a"  # H100 / H200


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


def variants() -> list[Variant]:
    """The configs the package picks on an H100/H200 at the Qwen3 shapes (bf16, V = 151936, G = 2, D = 128).

    From-logits: ``default_logits_config``, packed and padded; fused LM head: the sm_90 default of
    ``default_lm_head_config`` with and without a row map; the epilogue in every rule mode; paged decode:
    ``default_paged_attention_config``, split and not, and its merge. 11 variants.
    """
    from spec_rl.kernels import configs
    from spec_rl.kernels import paged_attention as PA
    from spec_rl.kernels.epilogue import EPILOGUE_BLOCK, epilogue_kernel
    from spec_rl.kernels.from_logits import verify_from_logits_kernel
    from spec_rl.kernels.lm_head import lm_head_partial_kernel

    out = []
    lg = configs.default_logits_config(151936, torch.bfloat16, interpret=False)
    ptr = dict(ids_ptr="*i64", row_sample_ptr="*i32", params_ptr="*i32")
    sig = _sig(verify_from_logits_kernel, logits_ptr="*bf16", **ptr)
    div = _pointers(sig, "V", "T", "stride_b", "stride_t")
    for packed in (True, False):
        const = dict(PACKED=packed, BLOCK_R=lg.block_r, BLOCK_V=lg.block_v)
        name = f"from_logits bf16 packed={packed} BLOCK_R={lg.block_r} BLOCK_V={lg.block_v} w{lg.num_warps}"
        out.append(Variant(name, verify_from_logits_kernel, sig, const, div, lg.num_warps, 1))

    lm = configs.LMHeadConfig(128, 256, 64, 8, 3)  # default_lm_head_config on sm_90
    ptr = dict(ids_ptr="*i64", row_off_ptr="*i64", params_ptr="*i32")
    sig = _sig(lm_head_partial_kernel, h_ptr="*bf16", w_ptr="*bf16", **ptr)
    div = _pointers(sig, "V", "D", "stride_h", "stride_w")
    tiles = dict(BLOCK_M=lm.block_m, BLOCK_N=lm.block_n, BLOCK_K=lm.block_k, FLATTEN=lm.flatten)
    for row_map in (False, True):
        const = dict(HAS_BIAS=False, HAS_ROW_MAP=row_map, ROW_ALIGN=8, EVEN_K=True, DOT_FP32=False, **tiles)
        name = (
            f"lm_head_partial bf16 bias=False even_k=True row_map={row_map} {lm.block_m}x{lm.block_n}x{lm.block_k} "
            f"w{lm.num_warps} s{lm.num_stages} splits~{lm.target_splits}"
        )
        out.append(Variant(name, lm_head_partial_kernel, sig, const, div, lm.num_warps, lm.num_stages))

    ints = dict.fromkeys(("n_ptr", "flag_ptr", "row_sample_ptr", "row_token_ptr", "params_ptr"), "*i32")
    sig = _sig(epilogue_kernel, acc_out_ptr="*i8", uids_ptr="*i64", **ints)
    const = {"BLOCK": EPILOGUE_BLOCK, "USE_LIBDEVICE": True}
    for mode in (0, 1, 2, 3):
        out.append(
            Variant(f"epilogue mode={mode}", epilogue_kernel, sig, {"MODE": mode, **const}, _pointers(sig, "N"), 4, 1)
        )

    pa = configs.default_paged_attention_config(2, 128, torch.bfloat16)
    ptr = dict(q_ptr="*bf16", kv_ptr="*bf16", out_ptr="*bf16", bt_ptr="*i32")
    sig = _sig(PA.paged_decode_kernel, seq_lens_ptr="*i32", qk_scale="fp32", **ptr)
    div = _pointers(sig, "stride_qb", "stride_qh", "stride_ob", "stride_oh", "stride_blk", "stride_kv")
    div += ["stride_tok", "stride_head"]
    for split in (False, True):
        const = dict(G=2, G_PAD=16 if pa.use_dot else 2, D=128, D_PAD=128, BLOCK_SIZE=16, BLOCK_N=pa.block_n)
        const.update(USE_DOT=pa.use_dot, DOT_F32=False, SPLIT=split)
        name = (
            f"paged_decode bf16 G=2 D=128 split={split} BLOCK_N={pa.block_n} "
            f"{'dot' if pa.use_dot else 'bcast'} w{pa.num_warps} s{pa.num_stages}"
        )
        out.append(Variant(name, PA.paged_decode_kernel, sig, const, div, pa.num_warps, pa.num_stages))
    msig = _sig(PA.paged_decode_merge_kernel, out_ptr="*bf16")
    mdiv = ["part_acc_ptr", "part_ml_ptr", "out_ptr", "stride_ob", "stride_oh"]
    merge = Variant(
        "paged_decode_merge bf16 D=128", PA.paged_decode_merge_kernel, msig, {"D": 128, "D_PAD": 128}, mdiv, 2, 1
    )
    return out + [merge]


def _ptxas_report(ptx: str) -> dict:
    from triton.backends.nvidia import compiler as nvc

    ptxas = nvc.get_ptxas(arch=ARCH).path if hasattr(nvc, "get_ptxas") else "ptxas"
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
        path = f.name
    try:
        out = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{PTX_ARCH}", path, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=False,
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


def _compile(fn, signature: dict, constexprs: dict, div16: list[str], num_warps: int, num_stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {}
    for name in names:
        sig[name] = "constexpr" if name in constexprs else signature[name]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    target = GPUTarget("cuda", ARCH, 32)
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


_JOBS: list[Variant] = []  # this run's variants, inherited by the forked workers


def _run_index(i: int) -> dict:
    return _run(_JOBS[i])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many forked processes")
    ap.add_argument("--json", type=H.json_path, help="write the report as JSON here (rewritten after every kernel)")
    args = ap.parse_args(argv)
    H.positive(ap, args, "jobs")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")
        return 2
    _JOBS[:] = variants()
    print(f"compile_check: {len(_JOBS)} kernel variants for sm_{ARCH}, {args.jobs} job(s)", flush=True)
    rec = H.RunRecord(args.json, {"arch": ARCH, "provenance": H.provenance("cpu"), "results": []}, report)
    pool = multiprocessing.get_context("fork").Pool(args.jobs) if args.jobs > 1 else None
    try:
        results = pool.imap(_run_index, range(len(_JOBS))) if pool else map(_run_index, range(len(_JOBS)))
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


def _run(v: Variant) -> dict:
    """Compile one :class:`Variant`; its ptxas numbers, or ``error``."""
    rec: dict = {"kernel": v.name}
    try:
        cc = _compile(v.kernel, v.signature, v.constexprs, v.div16, v.num_warps, v.num_stages)
        rec["shared"] = getattr(cc.metadata, "shared", None)
        rec.update(_ptxas_report(cc.asm["ptx"]))
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
