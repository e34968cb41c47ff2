"""The small GRPO trainer: config, loss, records, reports, checkpoints, held-out evaluation per epoch, the sweep.
Layer 9: may import every layer below (util .. tasks).

Run directory of :func:`run_modes` (``spec-rl train --out DIR``)::

    DIR/summary.json, run_info.json, report.md   rewritten (atomically) after every epoch
    DIR/report.png                               redrawn when a run ends
    DIR/<label>/metrics.jsonl                    one line per training step
    DIR/<label>/LATEST                           names the committed checkpoint version
    DIR/<label>/checkpoint-<steps>/              transformers checkpoint + optimizer.pt, rollout cache,
                                                 history index, trainer_state.json, COMPLETE marker

Each epoch record holds the rollout statistics, the rollout reward split by response origin and, with
held-out examples, the held-out evaluation after that epoch (the first record also the warm start's);
see :class:`GRPOTrainer` and :mod:`spec_rl.trainer.heldout`. A checkpoint version commits as one unit (:mod:`spec_rl.trainer.checkpoint`): resume after a kill at any
instant continues from the last finished epoch with the records of an uninterrupted run. Load a trained
policy with ``load_policy("DIR/spec")`` or ``from_pretrained("DIR/spec/checkpoint-<steps>")``.
"""

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
