"""Compile the verification kernels for a GPU target on a machine without a GPU.

Triton can lower a kernel to PTX and run its bundled ``ptxas`` without a
device, so this script catches GPU-only compile errors (which the CPU
interpreter cannot) and reports registers / spills / shared memory per
kernel and config, from ``ptxas -v``. It does not time anything. The
variants (kernel, signature, constexprs, warps / stages) are listed in
``benchmarks/compile_variants.py``.

Usage (TRITON_INTERPRET must be unset):

    python benchmarks/compile_check.py [--arch 90] [--sweep | --defaults-only] [--jobs 8] [--json PATH]

``--defaults-only`` compiles only the configs the package picks at the Qwen3
shapes (``compile_variants.default_variants``, the GPU check's stage 7);
``--jobs`` compiles in that many forked processes. One line per kernel is
printed as it compiles, the JSON is rewritten after every kernel, and the
exit code is 1 when any kernel fails to compile or assemble, or the
from-logits stream lacks 16-byte vector loads (``_status``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile

from _harness import Column, Table, provenance, write_json  # benchmarks/ is on sys.path when a script here runs


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


def _report_table(kernel_width: int) -> Table:
    gap = dict(gap="  ")
    return Table(
        Column("kernel", kernel_width, "<"),
        Column("status", 6, "<", **gap),
        Column("regs", 4, **gap),
        Column("spill_st", 8, **gap),
        Column("spill_ld", 8, **gap),
        Column("smem_bytes", 10, **gap),
        Column("wgmma", 5, **gap),
        Column("v4_loads", 8, **gap),
    )


def _status(rec: dict) -> str:
    if rec.get("error") is not None or rec.get("ptxas_rc", 0) != 0:
        return "FAIL"
    if rec["kernel"].startswith("from_logits") and not rec.get("vector_loads"):
        return "FAIL"  # the logits stream must be read with 16-byte vector loads
    return "ok"


def print_row(table: Table, r: dict) -> bool:
    """One line for one kernel (``ptxas -v`` numbers, flushed); True when it compiled cleanly."""
    status = _status(r)
    keys = ("registers", "spill_stores", "spill_loads", "shared", "uses_wgmma", "vector_loads")
    print(table.row(r["kernel"], status, *(str(r.get(k)) for k in keys)), flush=True)
    if r.get("error"):
        print("    " + r["error"].replace("\n", "\n    ")[:3000], flush=True)
    return status == "ok"


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
        help="only the configs the package picks at the Qwen3 shapes (compile_variants.default_variants)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many forked processes")
    ap.add_argument("--json", default=None, help="write the report as JSON here (rewritten after every kernel)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (the interpreter compiles nothing)")
        return 2
    import torch  # noqa: F401
    from compile_variants import all_variants, default_variants  # benchmarks/ is on sys.path when a script here runs

    arch = args.arch
    ptx_arch = f"{arch}a" if arch >= 90 else str(arch)
    variants = default_variants() if args.defaults_only else all_variants(args.sweep)
    _JOBS[:] = [(v, arch, ptx_arch) for v in variants]
    table = _report_table(max(len(v.name) for v in variants))
    print(f"compile_check: {len(variants)} kernel variants for sm_{arch}, {args.jobs} job(s)", flush=True)
    print(table.header(), flush=True)
    record = {"arch": arch, "provenance": provenance("cpu"), "results": []}
    ok = True
    pool = multiprocessing.get_context("fork").Pool(args.jobs) if args.jobs > 1 else None
    try:
        results = pool.imap(_run_index, range(len(variants))) if pool else map(_run_index, range(len(variants)))
        for rec in results:
            record["results"].append(rec)
            ok &= print_row(table, rec)
            if args.json:
                write_json(args.json, record, announce=None)
    finally:
        if pool is not None:
            pool.close()
    return 0 if ok else 1


def _run(v, arch: int, ptx_arch: str) -> dict:
    """Compile one :class:`compile_variants.Variant`; its ptxas numbers, or ``error``."""
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
