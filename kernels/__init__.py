"""Triton verification kernels for SPEC-RL (installed as ``spec_rl.kernels``).

Public API:

* :func:`verify_padded` -- padded [B, R] drafts in, (new log-probs, accept,
  rejection index) out: the ``"triton"`` backend of the verify functions.
* :func:`verify_packed_logits`, :func:`verify_packed_hidden`,
  :class:`PackedDrafts`, :class:`PackedVerifyOutput` -- packed rows
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

if __name__ == "spec_rl.kernels":
    from ._exports import *  # noqa: F403
    from ._exports import __all__  # noqa: F401
else:
    # Found as a top-level `kernels` because Python runs from the repository root (sys.path[0] is the
    # working directory): transformers then probes this folder as the Hugging Face `kernels` package.
    # Import nothing, and report a version that package checks reject, so it is never used as one.
    __version__ = "0"
    __all__: list[str] = []
