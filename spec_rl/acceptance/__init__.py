"""The rule: the float64 reference (lenient, exact, random reuse), verify() and its kernel dispatch, the exact walk,
adaptive lenience, and DraftScores (what a scoring pass hands the rule). Layer 3: may import util, ops, sampling.
"""

from .dispatch import verify
from .reference import ACCEPTANCE_RULES, LENIENCE_DEFAULTS, VerifyResult, VerifyStats, lenience_to_log
from .scores import DraftScores

__all__ = ["ACCEPTANCE_RULES", "LENIENCE_DEFAULTS", "DraftScores", "VerifyResult", "VerifyStats", "lenience_to_log", "verify"]
