"""The small GRPO trainer with speculative rollouts: config, loss, records, reports, checkpoints, the sweep.

Layer 8: may import every layer below (util .. tasks). Run directory: docs/api.md "Trainer" and docs/design.md
"Crash safety"."""

from .checkpoint import Checkpoint, latest_checkpoint
from .config import GRPOConfig
from .grpo import GRPOTrainer
from .loss import clipped_policy_loss, group_advantages, response_mask
from .run import load_policy, run_modes
from .rundir import RunDirError

__all__ = [
    "Checkpoint",
    "GRPOConfig",
    "GRPOTrainer",
    "RunDirError",
    "clipped_policy_loss",
    "group_advantages",
    "latest_checkpoint",
    "load_policy",
    "response_mask",
    "run_modes",
]
