"""Triton kernels of SPEC-RL (installed as ``spec_rl.kernels``): fused verification and paged decode attention.

API: docs/api.md "Kernels". Importing never fails: without Triton, :func:`is_available` is False and the entry
points raise ImportError. Without CUDA the kernels need ``TRITON_INTERPRET=1`` set before the first import."""

from __future__ import annotations

if __name__ == "spec_rl.kernels":
    from ._exports import *  # noqa: F403
    from ._exports import __all__  # noqa: F401
else:
    # A top-level `kernels` (repo root on sys.path) imports nothing; version "0" fails the Hub `kernels` checks.
    __version__ = "0"
    __all__: list[str] = []
