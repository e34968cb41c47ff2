"""The scoring pass: one forward of the current policy over [prompt, draft].

Token y_i of the draft is scored by the policy's output at the position
*before* it (the first response token by the last prompt position; DESIGN.md
rule step 1). The scorer returns, for every draft token, the final hidden
state at that position, so ``verify`` can apply the LM head itself (the fused
kernel path never materialises [N, V] logits). Models whose logits are not a
plain linear map of the last hidden state (logit soft-capping or scaling) are
detected once and scored from full logits instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class DraftScores:
    """Per-draft-token policy outputs, right-padded to R = max draft length.

    Exactly one of ``hidden_states`` ([B, R, d], with ``lm_head_weight``
    [V, d] and optional ``lm_head_bias`` [V]) or ``logits`` ([B, R, V]) is set.
    Row i of either scores draft token i.
    """

    hidden_states: torch.Tensor | None
    logits: torch.Tensor | None
    lm_head_weight: torch.Tensor | None
    lm_head_bias: torch.Tensor | None

    def logits_at(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Logits [K, V] (float32) at draft positions (rows[k], cols[k])."""
        if self.logits is not None:
            return self.logits[rows, cols].float()
        h = self.hidden_states[rows, cols].float()
        b = self.lm_head_bias.float() if self.lm_head_bias is not None else None
        return torch.nn.functional.linear(h, self.lm_head_weight.float(), b)


class PolicyScorer:
    """Runs the scoring forward of a transformers causal LM.

    Args:
        model: transformers ``PreTrainedModel`` with ``get_output_embeddings()``.
        pad_id: id used for right padding (masked out).
        max_tokens_per_forward: bound on padded B x L tokens per forward
            call; larger batches are split sample-wise after sorting by
            length. Default: 4096 on CPU (small chunks waste little padding
            and stay in cache: 2.7x faster than one big batch in the demo),
            65536 on GPU.
    """

    def __init__(self, model, pad_id: int, max_tokens_per_forward: int | None = None):
        self.model = model
        self.pad_id = int(pad_id)
        if max_tokens_per_forward is None:
            max_tokens_per_forward = 65536 if self.device.type == "cuda" else 4096
        self.max_tokens_per_forward = int(max_tokens_per_forward)
        self._hidden_path: bool | None = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _decoder(self):
        base = getattr(self.model, "base_model_prefix", None)
        decoder = getattr(self.model, base, None) if base else None
        return decoder if isinstance(decoder, torch.nn.Module) and decoder is not self.model else None

    @torch.no_grad()
    def _check_hidden_path(self) -> bool:
        """Is logits == lm_head(last_hidden_state)? Checked once on a 4-token input."""
        head = self.model.get_output_embeddings()
        decoder = self._decoder()
        if decoder is None or not isinstance(head, torch.nn.Linear):
            return False
        ids = torch.arange(4, device=self.device).unsqueeze(0) % head.weight.shape[0]
        full = self.model(input_ids=ids).logits.float()
        hidden = decoder(input_ids=ids).last_hidden_state
        mine = head(hidden).float()
        return bool(torch.allclose(full, mine, rtol=1e-3, atol=1e-3))

    @torch.no_grad()
    def score(self, prompts: Sequence[Sequence[int]], drafts: Sequence[Sequence[int]]) -> DraftScores:
        """Score every draft token under the current policy.

        Args:
            prompts: B prompt id lists (each non-empty).
            drafts: B draft id lists (may be empty).

        Returns:
            :class:`DraftScores` with R = max draft length (at least 1).
        """
        if len(prompts) != len(drafts):
            raise ValueError(f"prompts ({len(prompts)}) and drafts ({len(drafts)}) must have the same length")
        if self._hidden_path is None:
            self._hidden_path = self._check_hidden_path()
        bsz = len(prompts)
        max_r = max([len(d) for d in drafts] + [1])
        head = self.model.get_output_embeddings()
        width = head.weight.shape[1] if self._hidden_path else head.weight.shape[0]
        out = None
        order = sorted(range(bsz), key=lambda i: len(prompts[i]) + len(drafts[i]))
        start = 0
        while start < bsz:
            # Greedy chunking by padded token count.
            end = start + 1
            while end < bsz:
                longest = max(len(prompts[i]) + len(drafts[i]) for i in order[start : end + 1])
                if longest * (end + 1 - start) > self.max_tokens_per_forward:
                    break
                end += 1
            chunk = order[start:end]
            values = self._score_chunk([prompts[i] for i in chunk], [drafts[i] for i in chunk], max_r)
            if out is None:
                out = torch.zeros((bsz, max_r, width), dtype=values.dtype, device=values.device)
            out[torch.tensor(chunk, device=values.device)] = values
            start = end
        if self._hidden_path:
            return DraftScores(out, None, head.weight, getattr(head, "bias", None))
        return DraftScores(None, out, None, None)

    def _score_chunk(self, prompts, drafts, max_r: int) -> torch.Tensor:
        device = self.device
        bsz = len(prompts)
        seqs = [list(p) + list(d) for p, d in zip(prompts, drafts)]
        width = max(len(s) for s in seqs)
        ids = torch.full((bsz, width), self.pad_id, dtype=torch.long, device=device)
        attn = torch.zeros((bsz, width), dtype=torch.long, device=device)
        for row, s in enumerate(seqs):
            ids[row, : len(s)] = torch.as_tensor(s, dtype=torch.long)
            attn[row, : len(s)] = 1
        # Right padding: positions are 0..L-1 for every row, padding sits after the sequence.
        if self._hidden_path:
            states = self._decoder()(input_ids=ids, attention_mask=attn).last_hidden_state
        else:
            states = self.model(input_ids=ids, attention_mask=attn).logits
        # Draft token i of row b is scored at position len(prompt_b) - 1 + i.
        plen = torch.tensor([len(p) for p in prompts], device=device)
        pos = (plen.unsqueeze(1) - 1 + torch.arange(max_r, device=device).unsqueeze(0)).clamp(max=width - 1)
        return states.gather(1, pos.unsqueeze(-1).expand(-1, -1, states.shape[-1]))
