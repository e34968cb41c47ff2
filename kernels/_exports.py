"""Everything :mod:`spec_rl.kernels` exports (docs/api.md "Kernels")."""

from __future__ import annotations

try:
    import triton  # noqa: F401

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - exercised only without triton
    _IMPORT_ERROR = exc

# The configs need torch only: importable without Triton.
from .configs import LMHeadConfig, LogitsConfig, PagedAttentionConfig, default_lm_head_config, default_logits_config

if _IMPORT_ERROR is None:
    from ._common import INTERPRET
    from .api import (
        PackedDrafts,
        PackedVerifyOutput,
        is_available,
        logprobs_from_hidden,
        logprobs_from_logits,
        rows_from_cu_seqlens,
        verify_packed_hidden,
        verify_packed_logits,
        verify_padded,
    )
    from .paged_attention import paged_decode_attention
    from .philox import philox4x32_triton, philox_uniform_triton
else:  # pragma: no cover
    INTERPRET = False
    PackedVerifyOutput = PackedDrafts = None

    def is_available(device=None) -> bool:
        return False

    def _missing(*args, **kwargs):
        raise ImportError(f"spec_rl.kernels needs triton (pip install triton): {_IMPORT_ERROR}")

    verify_padded = verify_packed_logits = verify_packed_hidden = _missing
    logprobs_from_logits = logprobs_from_hidden = rows_from_cu_seqlens = _missing
    philox_uniform_triton = philox4x32_triton = _missing
    paged_decode_attention = _missing

__all__ = [
    "INTERPRET",
    "LMHeadConfig",
    "LogitsConfig",
    "PackedDrafts",
    "PackedVerifyOutput",
    "PagedAttentionConfig",
    "default_lm_head_config",
    "default_logits_config",
    "is_available",
    "logprobs_from_hidden",
    "logprobs_from_logits",
    "paged_decode_attention",
    "philox4x32_triton",
    "philox_uniform_triton",
    "rows_from_cu_seqlens",
    "verify_packed_hidden",
    "verify_packed_logits",
    "verify_padded",
]
