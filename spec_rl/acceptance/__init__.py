"""The rule: the run mode, the float64 reference (lenient, exact, random reuse), the verify functions and their
kernel dispatch, the exact walk, and DraftScores (what a scoring pass hands the rule).
Layer 3: may import util, ops, sampling.
"""

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
