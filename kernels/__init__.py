"""Triton verification kernels for SPEC-RL (installed as ``spec_rl.kernels``).

Public API:

* :func:`verify_padded` -- padded [B, R] drafts in, (new log-probs, accept,
  rejection index) out: the ``"triton"`` backend of ``spec_rl.verify``.
* :func:`verify_packed_logits`, :func:`verify_packed_hidden`,
  :func:`rows_from_cu_seqlens`, :class:`PackedVerifyOutput` -- packed rows
  (no padding) for trainers.
* :func:`logprobs_from_logits`, :func:`logprobs_from_hidden` -- score only.
* :func:`philox_uniform_triton` -- the verifier's uniforms, in a kernel.
* :func:`is_available` -- whether the kernels can run on a device.
* :func:`paged_decode_attention` -- decode attention over a paged KV cache
  (one query token per sequence; GQA; split-K for long contexts).
* tile configs (:mod:`.configs`): :class:`LogitsConfig`, :class:`LMHeadConfig`,
  :class:`PagedAttentionConfig` and their deterministic default rules.

Layout: one op per module with its launcher (:mod:`.from_logits`,
:mod:`.lm_head`, :mod:`.paged_attention`, :mod:`.philox`), the shared
verification epilogue (:mod:`.epilogue`), shared constants and helpers
(:mod:`._common`), configs and planners (:mod:`.configs`), and the public
verification entry points (:mod:`.api`).

Importing this package never fails: without Triton, :func:`is_available`
returns False and the entry points raise ImportError. On a machine without
CUDA the kernels run only under the Triton interpreter, which must be
enabled (``TRITON_INTERPRET=1``) *before* this package is first imported.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # pragma: no cover - exercised only without triton
    _IMPORT_ERROR = exc

from .configs import (  # torch only
    LMHeadConfig,
    LogitsConfig,
    PagedAttentionConfig,
    default_lm_head_config,
    default_logits_config,
)

if _IMPORT_ERROR is None:
    from ._common import INTERPRET
    from .api import (
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
    PackedVerifyOutput = None

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
