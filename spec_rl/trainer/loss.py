"""GRPO objective: group-normalised advantages and the clipped policy loss.

Advantages: GRPO (arXiv 2402.03300, Sec. 4.1.2); Dr. GRPO (arXiv 2503.20783) drops the std division. Loss: PPO's clipped
surrogate (Schulman et al. 2017, Eq. 7) with DAPO's clip-higher and token-mean aggregation (arXiv 2503.14476, Sec. 3.1
and 3.3), plus an optional k3 KL to a frozen reference (GRPO Eq. 4)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def group_advantages(
    rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Each reward minus its group's mean, divided by the group's unbiased std when ``scale_by_std`` (equal: 0).
    ``rewards``: [B] float, groups of ``group_size`` contiguous. Returns [B] float32; ValueError if B % G != 0."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards cannot be split into groups of {group_size}")
    r = rewards.float().reshape(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale_by_std and group_size > 1:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)
    return centred.reshape(-1)


def response_mask(response_ids: Sequence[Sequence[int]], eos_ids: set[int], width: int | None = None) -> torch.Tensor:
    """[B, R] bool: True from the first response token through the first EOS; R = ``width`` or the longest."""
    width = width if width is not None else max([len(r) for r in response_ids] + [1])
    mask = torch.zeros((len(response_ids), width), dtype=torch.bool)
    for b, resp in enumerate(response_ids):
        end = next((i + 1 for i, tok in enumerate(resp) if tok in eos_ids), len(resp))
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
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate, token mean over ``mask``, plus ``kl_coef`` times the k3 KL to ``ref_logprobs``; with
    ``is_weights`` [B, R] (a rollout correction's, :mod:`.correction`) each token's surrogate is weighted by its
    importance weight: the decoupled objective, old_logprobs the proximal policy.

    Args:
        logprobs, old_logprobs, ref_logprobs: [B, R] float: current (with grad), rollout, reference policy.
        advantages: [B] float, broadcast over tokens; mask: [B, R] bool, the response tokens.
        clip_low, clip_high: the ratio is clipped to [1 - clip_low, 1 + clip_high].
        num_tokens: divisor of the mean (default mask.sum()); the mini-batch total when accumulating micro-batches.
    Returns (scalar loss, metrics), a zero loss on the graph for an all-masked batch; ValueError for kl_coef > 0
    without ``ref_logprobs``."""
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
    if is_weights is not None:
        per_token = per_token * is_weights.to(per_token.dtype)
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
