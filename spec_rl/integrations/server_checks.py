"""What a rollout server's log-probs allow: sampling settings the speculative requests can score faithfully.

The acceptance test compares log-probs of the *sampling* distribution, softmax(process(logits)) with
the rollout's temperature, top-k and top-p (docs/design.md "The rule"). vLLM computes
``prompt_logprobs`` from the raw logits (temperature and top-k/top-p are not applied; verl's
distillation code says the same: "temperature has no effect on prompt_logprobs"), whatever its
``logprobs_mode``; the sampled-token log-probs follow ``logprobs_mode`` (verl sets
``processed_logprobs``). A raw log-prob cannot be rescaled to temperature T:
log softmax(z/T)_y = z_y/T - logsumexp(z/T) needs the whole logit vector, and the server returns one
number per position. So with ``prompt_logprobs_mode="raw"`` (the default, true for vLLM)
:func:`check_server_settings` refuses any temperature != 1, top-k or top-p, with an error that says
so; ``"processed"`` is for a server known to apply the sampling processing to prompt log-probs.
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

    Args:
        settings: the rollout's sampling settings.
        prompt_logprobs_mode: "raw" (log_softmax of the raw logits: vLLM) or
            "processed" (temperature/top-k/top-p applied).
        repetition_penalty: must be 1 (a penalty makes the sampling
            distribution depend on the tokens generated so far, which the
            scoring prefill does not reproduce).
        logprobs_mode: the server's mode for *sampled* token log-probs
            (vLLM's ``logprobs_mode``), or None if unknown. Logits modes are
            refused (they are not log-probabilities).

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
