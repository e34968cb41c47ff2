"""Stage 1 of the GPU check (docs/gpu-check.md): what the installed package and the machine can run.

    python -P benchmarks/gpu_env.py [--require-cuda] [--json PATH]

Prints versions and the device; where ``spec_rl`` was imported from (the installed package, not the source tree:
``python -P``); ``spec_rl._C`` and its native KV ops; whether the Triton kernels run on the device; the optional
packages the later stages import (``OPTIONAL``). Exit 1 when ``spec_rl`` or ``spec_rl._C`` cannot be imported
(nothing later can run); 3 when, with ``--require-cuda``, CUDA, the CUDA KV ops or the compiled kernels are missing
(the later stages still run). Without CUDA a ``NOTE:`` line says the CUDA parts were skipped.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from importlib import metadata

# module -> distribution: what the later stages import beyond torch / triton / transformers (make gpu-wheels)
OPTIONAL = {
    "math_verify": "math-verify",
    "latex2sympy2_extended": "latex2sympy2_extended",
    "antlr4": "antlr4-python3-runtime",
    "sympy": "sympy",
    "liger_kernel": "liger-kernel",
    "cut_cross_entropy": "cut-cross-entropy",
}


def _version(module: str, dist: str | None = None) -> str:
    """The installed version of ``module`` (of its distribution ``dist``), or "absent (why)"."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  any import failure is "absent", with its reason
        return f"absent ({type(exc).__name__}: {str(exc)[:120]})"
    try:
        return metadata.version(dist or module)
    except metadata.PackageNotFoundError:
        return getattr(mod, "__version__", "present")


def report(require_cuda: bool) -> tuple[dict, list[str], list[str], bool]:
    """(facts, problems, notes, importable): what was found, what makes the stage fail, what the summary
    should say, and whether spec_rl with spec_rl._C imported at all."""
    import torch

    facts: dict = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
    }
    problems: list[str] = []
    notes: list[str] = []
    for mod in ("triton", "transformers"):
        facts[mod] = _version(mod)
    if facts["cuda_available"]:
        facts["device"] = torch.cuda.get_device_name()
        facts["torch_cuda"] = torch.version.cuda
    elif require_cuda:
        problems.append("no CUDA device visible")
    try:
        import spec_rl
        import spec_rl._C  # noqa: F401
        import spec_rl.ops as ops
    except Exception as exc:  # noqa: BLE001
        problems.append(f"spec_rl / spec_rl._C not importable: {type(exc).__name__}: {exc}")
        return facts, problems, notes, False
    facts["spec_rl"] = os.path.dirname(spec_rl.__file__)
    if os.path.abspath(facts["spec_rl"]) == os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "spec_rl")):
        problems.append("spec_rl was imported from the source tree, not the installed package (run with python -P)")
    facts["native_kv_ops_cpu"] = ops.native_available("cpu")
    if facts["cuda_available"]:
        facts["native_kv_ops_cuda"] = ops.native_available("cuda")
        if not facts["native_kv_ops_cuda"]:
            problems.append("spec_rl._C was built without its CUDA KV ops")
    else:
        facts["native_kv_ops_cuda"] = "skipped: no CUDA"
        notes.append("CUDA ops skipped: no CUDA")
    try:
        import spec_rl.kernels as K

        device = "cuda" if facts["cuda_available"] else "cpu"
        facts["kernels"] = (
            f"{'interpreted' if K.INTERPRET else 'compiled'}, runnable on {device}: {K.is_available(device)}"
        )
        if require_cuda and facts["cuda_available"] and (K.INTERPRET or not K.is_available("cuda")):
            problems.append("spec_rl.kernels cannot run compiled on CUDA (TRITON_INTERPRET set?)")
    except ImportError as exc:
        facts["kernels"] = f"absent ({exc})"
        if require_cuda:
            problems.append("spec_rl.kernels is not importable")
    for mod, dist in OPTIONAL.items():
        facts[mod] = _version(mod, dist)
    return facts, problems, notes, True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--require-cuda", action="store_true", help="fail unless the CUDA ops and compiled kernels run")
    ap.add_argument("--json", default=None, help="also write the facts here")
    args = ap.parse_args(argv)
    facts, problems, notes, importable = report(args.require_cuda)
    for key, value in facts.items():
        print(f"{key}: {value}")
    if args.json:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with -P: benchmarks/ is not on sys.path
        from _harness import section, write_json

        record = {**facts, "problems": problems, "status": "problems" if problems else "ok"}
        body = [f"- {k}: {v}" for k, v in facts.items()] + [f"- **PROBLEM**: {p}" for p in problems]
        write_json(
            args.json, {**record, "report": section("Environment (stage 1, gpu_env.py)", record, body)}, announce=None
        )
    for p in problems:
        print(f"PROBLEM: {p}")
    if notes:
        print("NOTE: " + "; ".join(notes))
    if not importable:
        return 1
    return 3 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
