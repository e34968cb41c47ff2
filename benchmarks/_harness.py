"""The one harness every script in benchmarks/ runs on: timing, provenance, arguments, records and output.

Timing: :func:`gpu_time` (CUDA events through ``triton.testing.do_bench``, L2 flushed), :func:`wall_time` (host
clock around device synchronizes), :func:`synced` (for pytest-benchmark) and :func:`measure` (one timed call as a
result row; a failing call becomes an ``error`` row). Provenance: :func:`provenance` (device, versions, commit,
date) in every record. Records: :class:`RunRecord`, rewritten after every row with its markdown (``report``, the
tables of benchmarks/RESULTS.md, rendered by benchmarks/gpu_report.py's helpers, re-exported here) and the
failures that make a script exit non-zero; :func:`guarded` keeps one failing part from ending the run. Arguments:
:func:`arguments` (``--json``, ``--device``). Inputs: random models and LM heads.

>>> _, t = wall_time(lambda: torch.ones(4).sum(), "cpu", repeats=3)
>>> t.runs
3
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import torch
from gpu_report import cell, rows_table, section, speedups  # noqa: F401  (re-exported)

# Timed runs per row on the CPU (the smoke runs: the interpreter's times are not measurements).
CPU_REPEATS = 2


# ---------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timing:
    """Median and spread (20th / 80th percentiles) of repeated runs, all in one unit (ms or s)."""

    median: float
    low: float
    high: float
    runs: int

    @classmethod
    def from_samples(cls, samples: list[float]) -> Timing:
        q = statistics.quantiles(samples, n=5, method="inclusive") if len(samples) > 1 else samples * 4
        return cls(statistics.median(samples), q[0], q[3], len(samples))

    def record(self, key: str, scale: float = 1.0) -> dict:
        """``{key: median, key_p20: low, key_p80: high, "runs": runs}`` (times ``scale``) for a result row."""
        return {
            key: self.median * scale,
            f"{key}_p20": self.low * scale,
            f"{key}_p80": self.high * scale,
            "runs": self.runs,
        }


def device_arg(parser, value: str | None) -> torch.device:
    """``--device`` checked as the trainer checks it (a device this machine has; None: cuda if available, else
    cpu); a bad value ends the script with ``parser.error`` naming the flag."""
    from spec_rl.trainer.config import resolve_device

    try:
        return resolve_device("auto" if value is None else value)
    except ValueError as exc:  # its message starts with the field's name, "device"
        parser.error(f"--{exc}")


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (no-op on CPU)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synced(fn: Callable, device: torch.device | str) -> Callable:
    """``fn`` followed by :func:`sync`, so that a host timer (pytest-benchmark) sees the device time."""

    def call(*args, **kwargs):
        out = fn(*args, **kwargs)
        sync(device)
        return out

    return call


def wall_time(fn: Callable[[], Any], device: torch.device | str, *, repeats: int = 1):
    """``(output of the last call, Timing in seconds)`` of ``fn()``: ``repeats`` timed calls, each between device
    synchronizes (queued kernels count)."""
    samples, out = [], None
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        out = fn()
        sync(device)
        samples.append(time.perf_counter() - t0)
    return out, Timing.from_samples(samples)


def gpu_time(fn: Callable[[], Any], rep_ms: int) -> Timing:
    """CUDA-event times of ``fn()`` in ms from ``triton.testing.do_bench`` (``rep_ms`` budget, L2 flushed)."""
    import triton

    times = triton.testing.do_bench(fn, warmup=max(10, rep_ms // 4), rep=rep_ms, return_mode="all")
    return Timing.from_samples([float(t) for t in times])


def peak_extra_mb(fn: Callable[[], Any]) -> float:
    """Peak CUDA memory allocated during one ``fn()`` beyond what was allocated before it, in MiB."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base) / 2**20


def peak_extra_rss_mb(fn: Callable[[], Any]) -> float:
    """Peak resident memory during one ``fn()`` beyond the resident memory before it, in MiB (Linux, CPU tensors).

    Allocations of 64 KiB and more are made by mmap (glibc ``mallopt``), so a freed tensor leaves the resident set at
    once, and the kernel's peak (VmHWM) is reset before the call (``/proc/self/clear_refs``)."""
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed, no longer adaptive
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status_kib("VmRSS")
    out = fn()
    peak = proc_status_kib("VmHWM")
    del out
    return (peak - before) / 1024


def proc_status_kib(field: str, pid: int | str = "self") -> int:
    """A field of ``/proc/<pid>/status`` in KiB (VmRSS: resident now; VmHWM: the kernel's high-water mark of the
    resident set); 0 once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    except (OSError, StopIteration):
        return 0


def error_text(exc: BaseException, limit: int = 300) -> str:
    """``"Type: message"``, its first line, at most ``limit`` characters (an error row's or a failure's text)."""
    return (f"{type(exc).__name__}: {exc}".splitlines() or [""])[0][:limit]


def show(row: dict) -> str:
    """A result row as one printed line: its name, then its median (and extra memory), error or skip reason."""
    if "ms" in row:
        status = f"{row['ms']:.3f} ms" + ("" if row.get("extra_mb") is None else f", extra {row['extra_mb']:.1f} MB")
    else:
        status = row.get("error") or row.get("skipped", "")
    return f"  {row['name']:<48} {status}"


def measure(
    name: str, fn: Callable[[], Any], rec: RunRecord, *, rep_ms: int, memory: bool = False, device="cuda", **extra
) -> dict:
    """Time one call into a row ``{"name", **extra, "ms", "ms_p20", "ms_p80", "runs"[, "extra_mb"]}`` appended to
    ``rec.record["rows"]`` (printed, saved): one untimed call, then :func:`gpu_time` on CUDA, :func:`wall_time` on
    the CPU (the smoke runs: the interpreter's times are no measurement); ``memory``: :func:`peak_extra_mb` (None on
    the CPU). An exception becomes ``row["error"]``, so one failing row does not end the run."""
    row, on_cuda = {"name": name, **extra}, torch.device(device).type == "cuda"
    try:
        fn()
        sync(device)
        if on_cuda:
            row.update(gpu_time(fn, rep_ms).record("ms"))
        else:
            row.update(wall_time(fn, device, repeats=CPU_REPEATS)[1].record("ms", 1e3))
        if memory:
            row["extra_mb"] = peak_extra_mb(fn) if on_cuda else None
    except Exception as exc:  # noqa: BLE001  (a failing row is reported, not fatal)
        row["error"] = error_text(exc)
        traceback.print_exc(limit=2)
    rec.record["rows"].append(row)
    print(show(row), flush=True)
    rec.save()
    return row


def failed_rows(rows: list[dict]) -> list[str]:
    """``"name: error"`` for every row that raised (rows marked ``optional`` excepted: third-party
    competitors whose failure is reported in the table but is not ours)."""
    return [f"{r['name']}: {r['error']}" for r in rows if "error" in r and not r.get("optional")]


def kernels_for(parser, value: str | None, script: str):
    """``(device, spec_rl.kernels)`` of a kernel benchmark: ``--device`` (checked as :func:`device_arg` does; None:
    CUDA, and without CUDA the script exits 0, having measured nothing), the kernels compiled on CUDA
    (TRITON_INTERPRET dropped: interpreter timings say nothing about a GPU), interpreted on the CPU (the smoke runs set
    ``TRITON_INTERPRET=1`` before the package is imported). Exit 2 after printing why when they cannot run there."""
    if value is None and not torch.cuda.is_available():
        print(
            f"{script}: no CUDA device; nothing was measured (--device cpu: a smoke run under the Triton interpreter)"
        )
        raise SystemExit(0)
    device = device_arg(parser, value or "cuda")
    cuda = device.type == "cuda"
    if cuda:
        os.environ.pop("TRITON_INTERPRET", None)
    try:
        import spec_rl.kernels as K
    except ImportError as exc:
        print(f"{script}: spec_rl.kernels is not importable ({exc})")
        raise SystemExit(2) from None
    if cuda and K.INTERPRET:
        print(f"{script}: spec_rl.kernels was imported in interpreter mode (TRITON_INTERPRET set); unset it.")
        raise SystemExit(2)
    if not cuda and not K.is_available(device):
        print(f"{script}: the kernels cannot run on {device}: set TRITON_INTERPRET=1 for a CPU smoke run")
        raise SystemExit(2)
    return device, K


#: The tests of the smoke run arm a failing shape with ``SPEC_RL_FAULT="broken-shape:<script>[,<script>...]"``: each
#: named benchmark script adds one shape that must fail.
BROKEN_SHAPE = "broken-shape:"


def broken_shape_fault(*scripts: str) -> str:
    """The ``SPEC_RL_FAULT`` value that breaks a shape of each of ``scripts`` (e.g. "bench_paged_attention")."""
    return BROKEN_SHAPE + ",".join(scripts)


def broken_shape_requested(script: str) -> bool:
    """True when ``SPEC_RL_FAULT`` is a :data:`BROKEN_SHAPE` value naming ``script`` (e.g. "bench_paged_attention")."""
    armed = os.environ.get("SPEC_RL_FAULT", "")
    return armed.startswith(BROKEN_SHAPE) and script in armed[len(BROKEN_SHAPE) :].replace(" ", "").split(",")


# ---------------------------------------------------------------- provenance


def commit() -> str:
    """``$SPEC_RL_COMMIT``, else ``git rev-parse HEAD`` (+ "-dirty" with uncommitted changes), else "unknown"."""
    env = os.environ.get("SPEC_RL_COMMIT")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain"], capture_output=True, text=True, check=False
        )
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):  # no git: still benchmark
        return "unknown"


def _triton_version() -> str | None:
    if "triton" in sys.modules:
        return sys.modules["triton"].__version__
    for dist in ("triton", "pytorch-triton"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def provenance(device: torch.device | str | None = None) -> dict:
    """Where a result comes from: device (default CUDA when visible; its SM count and capability, or the CPU's
    threads), torch / triton / Python versions, commit and UTC date."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        where = {"device": props.name, "sm_count": props.multi_processor_count}
        where["capability"] = f"{props.major}.{props.minor}"
    else:
        where = {"device": f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"}
    return {
        **where,
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "commit": commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


# ---------------------------------------------------------------- output


def default_json_path(filename: str) -> str | None:
    """``$OUT/filename`` when ``OUT`` is set (the device runs collect ``$OUT``), else None."""
    return os.path.join(os.environ["OUT"], filename) if os.environ.get("OUT") else None


def write_json(path: str, record: dict, *, announce: str | None = "wrote") -> None:
    """Write ``record`` as indented JSON, atomically (``path.tmp`` renamed: a kill mid-write leaves the previous file),
    making the folder; nothing for ``path`` '' or None. Prints ``announce path`` unless ``announce`` is None."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, path)
    if announce is not None:
        print(f"{announce} {path}", flush=True)


class RunRecord:
    """A benchmark's JSON record, rewritten (atomically) whenever a row or a check is added.

    ``record`` is the script's own dict (provenance + its sections); this adds ``status`` ("running", then "ok" or
    "failed"), ``checks`` ({name: value}), ``failures`` (a failed shape, an error row, a check beyond its bound) and
    ``report``: ``report(record)``, the script's markdown (:func:`section`), rendered at every save, so a run cut at
    any point leaves every finished row on disk and in the GPU check's summary. ``path`` None: nothing is written.

    >>> r = RunRecord(None, {"rows": []})
    >>> r.check("max_abs_diff", 1e-6, 1e-3), r.finish()
    (True, 0)
    """

    def __init__(self, path: str | None, record: dict, report: Callable[[dict], list[str]] | None = None) -> None:
        self.path, self.record, self.report = path, record, report
        record.setdefault("checks", {})
        record["status"] = "running"
        record["failures"] = []
        self.save()

    def save(self) -> None:
        if self.report is not None:
            try:
                self.record["report"] = self.report(self.record)
            except Exception as exc:  # noqa: BLE001  a half-filled record must not stop the run
                self.record["report"] = [f"(report failed: {type(exc).__name__}: {exc})"]
        write_json(self.path, self.record, announce=None)

    def fail(self, what: str) -> None:
        """Record one failure (printed at once)."""
        self.record["failures"].append(what)
        print(f"FAILED: {what}", flush=True)
        self.save()

    def check(self, name: str, value: float, bound: float) -> bool:
        """Record an accuracy check ``value <= bound`` (NaN / inf fail); False and a failure when it does not hold."""
        value = float(value)
        self.record["checks"][name] = value
        ok = math.isfinite(value) and value <= bound
        if not ok:
            self.fail(f"check {name} = {value:.3g} exceeds {bound:.3g}")
        self.save()
        return ok

    def finish(self) -> int:
        """Mark the record done and print its report; 1 when anything failed, else 0 (the script's exit code)."""
        self.record["status"] = "failed" if self.record["failures"] else "ok"
        self.save()
        print("\n" + "\n".join(self.record.get("report", [])), flush=True)
        if self.path:
            print(f"wrote {self.path}")
        if self.record["failures"]:
            print(f"{len(self.record['failures'])} failure(s): " + "; ".join(self.record["failures"]), flush=True)
        return 1 if self.record["failures"] else 0


def guarded(rec: RunRecord, what: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or ``{"error": text}`` after recording its exception as a failure of ``what``: one failing row,
    shape or section is reported and the others still run."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001  reported, not fatal
        traceback.print_exc(limit=3)
        rec.fail(f"{what}: {error_text(exc)}")
        return {"error": error_text(exc)}


def run_recorded(rec: RunRecord, work: Callable[[], None]) -> int:
    """A benchmark's main body: ``work()`` (an exception is recorded as a failure, what finished stays in the
    record), then :meth:`RunRecord.finish`."""
    guarded(rec, "stopped", work)
    return rec.finish()


# ---------------------------------------------------------------- arguments


def arguments(doc: str, record: str, device: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring, ``--json`` (default ``$OUT/<record>``: the GPU check collects ``$OUT``)
    and, with ``device`` (its help), ``--device``."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--json", type=json_path, default=default_json_path(record), help=f"JSON record (default $OUT/{record})"
    )
    if device is not None:
        ap.add_argument("--device", help=device)
    return ap


def json_path(path: str) -> str:
    """``--json``, refused before the run unless :func:`write_json` can write there ('' writes nothing)."""
    try:  # write_json's steps on a probe file: the folder made, a file written, renamed and removed
        if os.path.isdir(path) or path.endswith(("/", os.sep)):
            raise IsADirectoryError(21, "a folder; name a file")
        if path:
            write_json(path + ".probe", {}, announce=None)
            os.remove(path + ".probe")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{path}: cannot write it ({exc.strerror or exc})") from None
    return path


def positive(ap, args, *names: str, low: float = 1) -> None:
    """``ap.error`` naming the flag when a value of ``names`` (attributes of ``args``; None: unset; a list: each of its
    values) is below ``low`` or not finite."""
    for name in names:
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not (math.isfinite(v) and v >= low):
                ap.error(f"--{name.replace('_', '-')} must be >= {low:g}, got {v}")


def numbers(ap, flag: str, text: str, kind=int) -> list:
    """Comma-separated numbers of ``flag`` (ints >= 1, finite floats >= 0), or ``ap.error``."""
    low = 1 if kind is int else 0
    try:
        values = [kind(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v >= low for v in values):
        ap.error(f"{flag} takes comma-separated {'integers' if kind is int else 'numbers'} >= {low}, got {text!r}")
    return values


# ---------------------------------------------------------------- inputs


def random_lm_head(vocab: int, d: int, dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    """[vocab, d] LM-head weight scaled so that unit-variance hidden states give logits of std ~2.5."""
    return (torch.randn(vocab, d, device=device, generator=gen) * (2.5 / math.sqrt(d))).to(dtype)


def random_model(vocab: int, device, dtype: torch.dtype, *, qwen3: bool = False, **shape):
    """A randomly initialised causal LM built on ``device``: Qwen3-0.6B's published shapes (``qwen3``; throughput
    does not depend on the weights) or a 2-layer Qwen2 of width 64, ``shape`` overriding either config."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if qwen3:
        big = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16)
        config = Qwen3Config(vocab_size=vocab, **{**big, "num_key_value_heads": 8, "head_dim": 128, **shape})
    else:
        small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
        config = Qwen2Config(vocab_size=vocab, **{**small, "num_key_value_heads": 2, **shape})
    torch.manual_seed(0)
    with torch.device(device):  # initialised where it runs: a 0.6B model's CPU init alone takes seconds
        model = (Qwen3ForCausalLM if qwen3 else Qwen2ForCausalLM)(config)
    return model.to(dtype=dtype).eval()
