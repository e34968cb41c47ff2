"""Rollout correction: importance weights of the tokens a rollout reused against the policy that produced them
(docs/design.md "Rollout correction"), in the forms the RL frameworks use (verl's Rollout Correction, slime's TIS/MIS,
ms-swift's rollout_importance_sampling_mode).

Per response token, w = pi_old(y) / pi_behaviour(y): pi_old is the policy the rollout ran under (the PPO ratio's
denominator), pi_behaviour the probability of the path that produced the token (``RolloutResult.behaviour_logprobs``).
A generated token has w = 1; a reused one carries the staleness of its draft. The policy loss of each token is
multiplied by the corrected weight, the decoupled PPO objective of verl (Hilton et al. 2022): ``tis`` truncates w at
the threshold (token-level truncated IS), ``mis`` masks the tokens whose w passes it (masked IS: they leave the loss
and its token count)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ..util.validation import check_choice, check_real

KINDS = ("tis", "mis")
#: verl's rollout_is_threshold and ms-swift's default.
THRESHOLD = 2.0


@dataclass(frozen=True)
class RolloutCorrection:
    """``kind``: "tis" (truncate w at ``threshold``) or "mis" (mask tokens with w > ``threshold``); ``threshold`` > 1.
    ValueError for another kind or a threshold <= 1; TypeError for a threshold that is not a number."""

    kind: str = "tis"
    threshold: float = THRESHOLD

    def __post_init__(self) -> None:
        check_choice("kind", self.kind, KINDS)
        value = check_real("threshold", self.threshold, low=1.0, low_open=True, hint=" (verl's default is 2)")
        object.__setattr__(self, "threshold", value)

    @property
    def name(self) -> str:
        """The name :meth:`parse` reads back, e.g. "tis" or "mis:5"."""
        return self.kind if self.threshold == THRESHOLD else f"{self.kind}:{self.threshold:g}"

    @classmethod
    def parse(cls, text) -> RolloutCorrection | None:
        """``none`` (None), ``tis``, ``mis`` or either with ``:<threshold>`` (e.g. ``tis:3``); a RolloutCorrection or
        None is returned as it is. ValueError naming the choices."""
        if text is None or isinstance(text, RolloutCorrection):
            return text
        match = re.fullmatch(r"(\w+)(?::(.+))?", text.strip()) if isinstance(text, str) else None
        if match is not None and match[1] == "none" and match[2] is None:
            return None
        if match is None or match[1] not in KINDS:
            raise ValueError(
                f"rollout_correction must be none, {', '.join(KINDS)} or <kind>:<threshold> (e.g. tis:2), got {text!r}"
            )
        try:
            return cls(match[1], float(match[2]) if match[2] is not None else THRESHOLD)
        except ValueError:
            raise ValueError(
                f"rollout_correction {text!r}: the threshold must be a finite number > 1 (e.g. {match[1]}:2)"
            ) from None

    def weights(self, log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [B, R] float32, kept [B, R] bool) from log w = log pi_old - log pi_behaviour [B, R] and the
        response ``mask`` [B, R] bool: truncated (tis) or masked (mis) weights, 0 outside the kept tokens."""
        w = torch.exp(log_ratio.double().clamp(max=math.log(1e30)))
        if self.kind == "tis":
            kept = mask
            w = w.clamp(max=self.threshold)
        else:
            kept = mask & (w <= self.threshold)
        return torch.where(kept, w, torch.zeros_like(w)).float(), kept


def weight_sums(log_ratio: torch.Tensor, mask: torch.Tensor, correction: RolloutCorrection | None) -> dict:
    """The step's importance-weight sums over the response tokens ``mask`` [B, R] (log w [B, R]): tokens, sum and
    sum of squares of w, its max, and the tokens the correction changed (truncated or masked; with none, those past
    the default threshold). An epoch adds them up (:func:`weight_stats`)."""
    w = torch.exp(log_ratio.double().clamp(max=math.log(1e30)))[mask]
    threshold = correction.threshold if correction is not None else THRESHOLD
    return {
        "is_tokens": int(w.numel()),
        "is_sum": float(w.sum()),
        "is_sq_sum": float((w * w).sum()),
        "is_max": float(w.max()) if w.numel() else 1.0,
        "is_corrected": int((w > threshold).sum()),
    }


#: The keys of :func:`weight_sums` that add up over steps and epochs (``is_max`` takes the largest).
WEIGHT_SUMS = ("is_tokens", "is_sum", "is_sq_sum", "is_corrected")


def weight_stats(parts) -> dict:
    """Mean, max, share corrected and effective sample size (sum w)^2 / (N sum w^2) in (0, 1] of the weights whose
    sums :func:`weight_sums` gave, over ``parts`` (dicts carrying those sums: steps or epoch records)."""
    parts = list(parts)
    sums = {k: sum(p.get(k, 0) for p in parts) for k in WEIGHT_SUMS}
    # the largest weight of the parts that weighed tokens (one without any has no largest weight)
    sums["is_max"] = max(
        (p["is_max"] for p in parts if p.get("is_tokens") and p.get("is_max") is not None), default=1.0
    )
    n = sums["is_tokens"]
    if not n:
        return {"is_mean": None, "is_max": None, "is_corrected_share": None, "is_ess": None}
    return {
        "is_mean": sums["is_sum"] / n,
        "is_max": sums["is_max"],
        "is_corrected_share": sums["is_corrected"] / n,
        "is_ess": sums["is_sum"] ** 2 / (n * sums["is_sq_sum"]) if sums["is_sq_sum"] > 0 else None,
    }
