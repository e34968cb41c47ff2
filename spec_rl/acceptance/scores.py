"""The current policy's scores of a batch of drafts, as the acceptance rule consumes them.

:class:`DraftScores` is what a backend's scoring pass returns (hidden states with the LM head, full
logits, or log-probs already computed) and what :func:`spec_rl.acceptance.reference.dispatch.verify`, the
lenient rule and the exact walk read; :func:`response_positions` says which output scores which
draft token (paper Sec. 3, docs/design.md "The rule", step 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftScores:
    """The current policy's scores of B drafts, right-padded to R = max draft length.

    Exactly one source is set: ``new_logprobs`` [B, R] (sampling log-probs,
    already computed), ``logits`` [B, R, V], or ``hidden_states`` [B, R, d]
    with ``lm_head_weight`` [V, d] and optional ``lm_head_bias`` [V] (the
    fused path: logits are never formed for the whole batch). Row i of any
    source scores draft token i, i.e. it is the output at the position
    *before* token i.

    ``same_as`` [B, R] int64 (optional, set by the tree-packed scorer): the flat index
    ``b' * R + r'`` of a position scored by the *same* output as (b, r) (same prompt and same
    draft prefix), so the LM head and log-softmax run once per distinct output
    (:func:`spec_rl.acceptance.reference.draft_logprobs`, :meth:`distinct_logits_at`). Padding points at itself.
    """

    hidden_states: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    lm_head_weight: torch.Tensor | None = None
    lm_head_bias: torch.Tensor | None = None
    new_logprobs: torch.Tensor | None = None
    same_as: torch.Tensor | None = None

    @property
    def source(self) -> str:
        """Which source is set: "new_logprobs", "logits" or "hidden_states"."""
        if self.new_logprobs is not None:
            return "new_logprobs"
        return "logits" if self.logits is not None else "hidden_states"

    @property
    def device(self) -> torch.device:
        return next(t for t in (self.new_logprobs, self.logits, self.hidden_states) if t is not None).device

    @torch.no_grad()
    def logits_at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Logits [K, V] (float32) at draft positions (rows[k], cols[k]); the LM head runs in at least float32.

        For sampling (the token at a rejection), never for training: no autograd graph is built, even
        when the LM head is a Parameter with ``requires_grad=True``.
        """
        logits, index = self.distinct_logits_at(rows, cols)
        return logits if index is None else logits[index]

    @torch.no_grad()
    def distinct_logits_at(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [U, V] (float32) of the distinct outputs at (rows[k], cols[k]), and index [K] into them.

        ``index`` is None when no dedup applies (then U = K, in order). With :attr:`same_as` the LM
        head runs once per distinct output: the G samples of a group walking the same draft share them.
        """
        if self.logits is not None:
            return self.logits[rows, cols].float(), None
        dtype = torch.promote_types(self.lm_head_weight.dtype, torch.float32)
        index = None
        if self.same_as is not None:
            distinct, index = torch.unique(self.same_as[rows, cols], return_inverse=True)
            h = self.hidden_states.reshape(-1, self.hidden_states.shape[-1])[distinct].to(dtype)
        else:
            h = self.hidden_states[rows, cols].to(dtype)
        b = self.lm_head_bias.to(dtype) if self.lm_head_bias is not None else None
        return torch.nn.functional.linear(h, self.lm_head_weight.to(dtype), b).float(), index


def response_positions(prompt_lens: torch.Tensor, max_r: int, width: int | None = None) -> torch.Tensor:
    """Positions [B, max_r] whose output scores response token i: ``len(prompt) - 1 + i``.

    Clamped to ``width - 1`` (the padded sequence width) where a row's response
    is shorter than ``max_r``; those padded rows are masked by the caller.
    """
    pos = prompt_lens.unsqueeze(1) - 1 + torch.arange(max_r, device=prompt_lens.device).unsqueeze(0)
    return pos if width is None else pos.clamp(max=width - 1)
