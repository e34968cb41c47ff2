"""Sampling settings whose log-probs a rollout server can score faithfully (docs/integrations.md "Log-prob modes").

vLLM's ``prompt_logprobs`` come from the raw logits, and a raw log-prob cannot be rescaled to the sampling
distribution (temperature, top-k/top-p) without the whole logit vector.
"""

from __future__ import annotations

from ..sampling.distribution import SamplingSettings

__all__ = ["PROMPT_LOGPROBS_MODES", "check_server_settings"]

PROMPT_LOGPROBS_MODES = ("raw", "processed")


def check_server_settings(
    settings: SamplingSettings,
    prompt_logprobs_mode: str = "raw",
    repetition_penalty: float = 1.0,
    logprobs_mode: str | None = None,
) -> None:
    """Refuse a sampling configuration whose log-probs the server cannot score faithfully.

    ``prompt_logprobs_mode``: "raw" (vLLM; then only temperature 1 without top-k/top-p passes) or "processed" (for
    a server known to apply them). ``repetition_penalty`` must be 1: the scoring prefill does not apply it.
    ``logprobs_mode``: the server's mode for sampled-token log-probs (vLLM's), None if unknown; logits modes fail.

    Raises:
        ValueError: naming the setting and the fix.
    """
    if prompt_logprobs_mode not in PROMPT_LOGPROBS_MODES:
        raise ValueError(f"prompt_logprobs_mode must be one of {PROMPT_LOGPROBS_MODES}, got {prompt_logprobs_mode!r}")
    if prompt_logprobs_mode == "raw" and not (settings.temperature == 1.0 and settings.is_plain):
        raise ValueError(
            f"the rollout samples with temperature={settings.temperature}, top_k={settings.top_k}, "
            f"top_p={settings.top_p}, but the server's prompt_logprobs are raw (log_softmax of unscaled logits; "
            "vLLM ignores temperature/top-k/top-p for prompt logprobs), and a raw log-prob cannot be rescaled "
            "without the full logit vector. Use temperature=1.0, top_k=-1 (or 0), top_p=1.0, or set "
            "prompt_logprobs_mode='processed' only if your server applies them to prompt logprobs."
        )
    if not (isinstance(repetition_penalty, (int, float)) and float(repetition_penalty) == 1.0):
        raise ValueError(
            f"repetition_penalty={repetition_penalty!r} is not supported: the penalised distribution depends on "
            "previously generated tokens, which the scoring prefill does not apply; set it to 1.0"
        )
    if logprobs_mode is not None and logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
        raise ValueError(
            f"logprobs_mode={logprobs_mode!r} returns logits, not log-probabilities; drafts need sampling "
            "log-probs: set the rollout's logprobs_mode to 'processed_logprobs'"
        )
