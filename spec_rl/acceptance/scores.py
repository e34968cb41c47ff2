"""The current policy's scores of a batch of drafts: what a backend's scoring pass hands the verify functions, the
lenient rule and the exact walk (SPEC-RL Sec. 3; docs/design.md "The rule", step 1)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftScores:
    """The current policy's scores of B drafts, right-padded to R = max draft length.

    Exactly one source: ``new_logprobs`` [B, R] (sampling log-probs), ``logits`` [B, R, V], or ``hidden_states``
    [B, R, d] with ``lm_head_weight`` [V, d] and optional ``lm_head_bias`` [V]. Row i scores draft token i (the
    output before it). ``same_as`` [B, R] int64 (optional, tree-packed scorer): flat index ``b' * R + r'`` of a
    position scored by the same output (padding points at itself), so the LM head runs once per distinct output.
    """

    hidden_states: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    lm_head_weight: torch.Tensor | None = None
    lm_head_bias: torch.Tensor | None = None
    new_logprobs: torch.Tensor | None = None
    same_as: torch.Tensor | None = None

    @property
    def source(self) -> str:
        """The source that is set: "new_logprobs", "logits" or "hidden_states"."""
        if self.new_logprobs is not None:
            return "new_logprobs"
        return "logits" if self.logits is not None else "hidden_states"

    @property
    def device(self) -> torch.device:
        return next(t for t in (self.new_logprobs, self.logits, self.hidden_states) if t is not None).device

    @property
    def vocab_size(self) -> int | None:
        """V of the logits or the LM head; None for precomputed log-probs."""
        if self.logits is not None:
            return int(self.logits.shape[-1])
        return int(self.lm_head_weight.shape[0]) if self.lm_head_weight is not None else None

    @torch.no_grad()
    def logits_at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Logits [K, V] float32 at draft positions (rows[k], cols[k]), for sampling: no autograd graph is built."""
        logits, index = self.distinct_logits_at(rows, cols)
        return logits if index is None else logits[index]

    @torch.no_grad()
    def distinct_logits_at(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [U, V] float32 of the distinct outputs at (rows[k], cols[k]), and index [K] into them (None without
        :attr:`same_as`: then U = K, in order). No autograd graph is built."""
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
    """Positions [B, max_r] whose output scores response token i: ``len(prompt) - 1 + i``, at most ``width - 1``."""
    pos = prompt_lens.unsqueeze(1) - 1 + torch.arange(max_r, device=prompt_lens.device).unsqueeze(0)
    return pos if width is None else pos.clamp(max=width - 1)
