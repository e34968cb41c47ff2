"""A detector of what a CUDA graph cannot hold, run on the CPU (not a test module): inside ``with HostData() as
seen`` every op that makes the host wait for the device or moves host data into a step is recorded in ``seen.ops``.

Recorded: a tensor made from Python values (``lift_fresh``: a copy from host memory, which capture refuses), a
scalar tensor (``scalar_tensor``), reading a value (``_local_scalar_dense``: item, int, bool), shapes that depend on
values (``nonzero``, boolean indexing, ``masked_select``, ``unique``, ``equal``), a copy that names a device, and the
reads that dispatch no op on a CPU tensor: ``tolist``, ``numpy``, ``__array__`` and printing (``__repr__``,
``__str__``, ``__format__``). ``seen.opaque(fn)`` runs ``fn`` unwatched: a kernel launch is one op on the device (the
Triton launchers allocate with ``torch.empty`` only), and the Triton interpreter that runs it on a CPU moves data
itself."""

from __future__ import annotations

import contextlib
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode_temporarily

_FLAGGED = {"lift_fresh", "lift_fresh_copy", "scalar_tensor", "_local_scalar_dense", "nonzero", "masked_select"}
_FLAGGED |= {"unique", "_unique2", "unique_consecutive", "equal"}
_READS = ("tolist", "numpy", "__array__", "__repr__", "__str__", "__format__")


class HostData(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self._patches = contextlib.ExitStack()
        self._paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else [x])]
        bool_index = name.startswith("index") and any(
            isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in flat
        )
        moves = name in ("_to_copy", "to") and kwargs.get("device") is not None
        if name in _FLAGGED or bool_index or moves:
            self.ops.append(func.__name__)
        return func(*args, **kwargs)

    def __enter__(self):
        for read in _READS:
            original = getattr(torch.Tensor, read)
            self._patches.enter_context(_patched(torch.Tensor, read, self._recording(read, original)))
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._patches.close()
        return out

    def _recording(self, name, original):
        @functools.wraps(original)
        def read(tensor, *args, **kwargs):
            if not self._paused:
                self.ops.append(name)
            return original(tensor, *args, **kwargs)

        return read

    def opaque(self, fn):
        """``fn`` run unwatched (a kernel launch: one op on the device)."""

        @functools.wraps(fn)
        def run(*args, **kwargs):
            self._paused += 1
            try:
                with _pop_mode_temporarily():
                    return fn(*args, **kwargs)
            finally:
                self._paused -= 1

        return run


@contextlib.contextmanager
def _patched(owner, name, value):
    original = owner.__dict__.get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if original is None:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
