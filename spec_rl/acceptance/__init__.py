"""The SPEC-RL acceptance rule: the rules, the run mode, the verify functions and their kernel dispatch, the torch
reference and the exact walk. Layer 3: may import util, ops, sampling."""

from .dispatch import VerifyOptions, verify_hidden, verify_logits, verify_logprobs
from .mode import MODES, TAIL_WIDTH, RolloutMode
from .reference import VerifyResult, VerifyStats
from .rules import RULES, Exact, Lenient, RandomReuse, Rule, register_rule
from .scores import DraftScores

__all__ = [
    "MODES",
    "RULES",
    "TAIL_WIDTH",
    "DraftScores",
    "Exact",
    "Lenient",
    "RandomReuse",
    "RolloutMode",
    "Rule",
    "VerifyOptions",
    "VerifyResult",
    "VerifyStats",
    "register_rule",
    "verify_hidden",
    "verify_logits",
    "verify_logprobs",
]
