"""Small GRPO trainer with speculative rollouts (SPEC-RL)."""

from .config import MODES, GRPOConfig
from .grpo import GRPOTrainer
from .loss import clipped_policy_loss, group_advantages, response_mask
from .run import load_policy, run_modes

__all__ = [
    "MODES",
    "GRPOConfig",
    "GRPOTrainer",
    "clipped_policy_loss",
    "group_advantages",
    "load_policy",
    "response_mask",
    "run_modes",
]
