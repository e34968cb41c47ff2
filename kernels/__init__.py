"""Triton kernels of SPEC-RL, installed as ``spec_rl.kernels``: one op per file with its launcher beside it (fused
verification from logits or hidden states, paged decode attention, keyed Gumbel-max sampling; the device Philox
they share). The public entry
points are spec_rl's verify functions; these are the layer under them (docs/design.md "Module map").

Without Triton, :func:`is_available` is False and nothing else is exported. Without CUDA the kernels need
``TRITON_INTERPRET=1`` set before the first import."""

from __future__ import annotations

if __name__ == "spec_rl.kernels":
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - exercised only without triton
        INTERPRET = False

        def is_available(device=None) -> bool:
            return False

    else:
        from ._common import INTERPRET, DraftRows, InvalidScores, is_available  # noqa: F401
        from .configs import LMHeadConfig, LogitsConfig, PagedAttentionConfig  # noqa: F401
        from .from_logits import verify_logits  # noqa: F401
        from .gumbel_max import gumbel_argmax  # noqa: F401
        from .lm_head import verify_hidden, verify_hidden_padded  # noqa: F401
        from .paged_attention import paged_decode_attention  # noqa: F401
else:
    # A top-level `kernels` (repo root on sys.path) imports nothing; version "0" fails the Hub `kernels` checks.
    __version__ = "0"
    __all__: list[str] = []
