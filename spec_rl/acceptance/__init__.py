"""The SPEC-RL acceptance rule: run modes, the verify functions and their kernel dispatch, the torch reference and
the exact walk. Layer 3: may import util, ops, sampling."""

from .dispatch import VerifyOptions, verify_hidden, verify_logits, verify_logprobs
from .mode import ACCEPTANCE_RULES, LENIENCE_DEFAULTS, MODES, REJECTION_DRAWS, RolloutMode
from .reference import VerifyResult, VerifyStats
from .scores import DraftScores

__all__ = [
    "ACCEPTANCE_RULES",
    "LENIENCE_DEFAULTS",
    "MODES",
    "REJECTION_DRAWS",
    "DraftScores",
    "RolloutMode",
    "VerifyOptions",
    "VerifyResult",
    "VerifyStats",
    "verify_hidden",
    "verify_logits",
    "verify_logprobs",
]
