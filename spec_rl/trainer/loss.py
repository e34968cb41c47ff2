"""GRPO objective: group-normalised advantages and the clipped policy loss.

* Advantages (GRPO, Shao et al. 2024, arXiv 2402.03300, Sec. 4.1.2): each
  sample's reward minus its group's mean, divided by the group's standard
  deviation (optional; Dr. GRPO, arXiv 2503.20783, drops the division).
* Loss (PPO, Schulman et al. 2017, Eq. 7) with separate lower/upper clip
  ranges; DAPO's clip-higher (arXiv 2503.14476, Sec. 3.1) uses eps_high >
  eps_low (0.28 vs 0.2). Token-mean aggregation over all response tokens of
  the mini-batch (DAPO Sec. 3.3).
* Optional KL penalty to a frozen reference policy with the k3 estimator
  (Schulman, "Approximating KL divergence", 2020), as in GRPO Eq. 4.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-normalised advantages.

    Args:
        rewards: [B] float rewards, B = num_groups * group_size, groups contiguous.
        group_size: G samples per prompt.
        scale_by_std: divide by the group's (unbiased) std; groups whose
            rewards are all equal get advantage 0.

    Returns:
        [B] float32 advantages.

    Raises:
        ValueError: B is not a multiple of ``group_size``.
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    r = rewards.float().reshape(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def response_mask(response_ids: Sequence[Sequence[int]], eos_ids: set[int], width: int | None = None) -> torch.Tensor:
    """[B, R] bool: True from the first response token through the first EOS (inclusive).

    Padding and anything after the first EOS are excluded.
    """
    width = width if width is not None else max([len(r) for r in response_ids] + [1])
    mask = torch.zeros((len(response_ids), width), dtype=torch.bool)
    for b, resp in enumerate(response_ids):
        end = len(resp)
        for i, tok in enumerate(resp):
            if tok in eos_ids:
                end = i + 1
                break
        mask[b, : min(end, width)] = True
    return mask


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with token-mean aggregation (+ optional k3 KL).

    Args:
        logprobs: [B, R] current log-probs (with grad).
        old_logprobs: [B, R] rollout log-probs.
        advantages: [B] per-sample advantages (broadcast over tokens).
        mask: [B, R] bool response-token mask.
        clip_low, clip_high: ratio clipped to [1 - clip_low, 1 + clip_high].
        ref_logprobs: [B, R] reference-policy log-probs, needed when kl_coef > 0.
        num_tokens: divisor of the token mean (default: mask.sum()); pass the
            mini-batch total when accumulating over micro-batches.

    Returns:
        (scalar loss, metrics). An all-masked or empty batch gives a zero loss
        (still connected to the graph), never NaN.
    """
    m = mask.to(logprobs.dtype)
    denom = float(num_tokens) if num_tokens is not None else float(m.sum())
    if denom == 0 or logprobs.numel() == 0:
        return logprobs.sum() * 0.0, {"clip_frac": 0.0, "kl": 0.0, "ratio_mean": 1.0}
    log_ratio = torch.where(mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(1).to(logprobs.dtype)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(surr1, surr2)
    kl_value = 0.0
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs from the frozen reference policy")
        delta = torch.where(mask, ref_logprobs - logprobs, torch.zeros_like(logprobs))
        kl = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * kl
        kl_value = float((kl.detach() * m).sum() / m.sum().clamp(min=1))
    loss = (per_token * m).sum() / denom
    with torch.no_grad():
        clipped = ((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high)) & mask
        metrics = {
            "clip_frac": float(clipped.sum() / m.sum().clamp(min=1)),
            "kl": kl_value,
            "ratio_mean": float((ratio * m).sum() / m.sum().clamp(min=1)),
        }
    return loss, metrics
