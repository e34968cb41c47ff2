"""The ``spec_rl/*`` metrics :class:`~spec_rl.integrations.trl.SpecRLRollout` logs to TRL's metric log: reuse
statistics per training rollout, and the reward split by response origin, since TRL's ``reward`` mixes the origins."""

from __future__ import annotations

import torch

from ..rollout.reward_split import ORIGINS, origin_sums, response_origins
from .trl_checks import UnsupportedTrainerConfig

#: The RolloutStats keys logged per training call as ``spec_rl/<key>``.
ROLLOUT_METRICS = (
    *("full_reuse_ratio", "mean_verified_prefix", "reused_tokens", "tokens_generated", "rollout_seconds"),
    *("decode_steps", "tail_accepted"),
)


def log_rollout_metrics(trainer, stats: dict) -> None:
    """Log the reuse statistics of one training rollout (``RolloutStats.to_dict()``)."""
    trainer._log_metric("spec_rl/draft_found_ratio", stats["drafts_found"] / max(stats["num_samples"], 1))
    for key in ROLLOUT_METRICS:
        trainer._log_metric(f"spec_rl/{key}", float(stats[key]))


def weighted_rewards(trainer, rewards_per_func: torch.Tensor) -> list[float]:
    """TRL's logged reward per row of ``rewards_per_func`` ([B, F], one column per reward function): the
    ``reward_weights``-weighted nansum, NaN where every function gave NaN."""
    weights = trainer.reward_weights.to(rewards_per_func.device).unsqueeze(0)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
    return rewards.tolist()


def hook_reward_split(trainer, spec) -> None:
    """Wrap ``trainer._calculate_rewards`` to log ``spec_rl/reward_<origin>`` and ``spec_rl/count_<origin>``.

    Per training batch and origin of ``spec.last_result`` (:mod:`spec_rl.rollout.reward_split`): each response's
    reward, one value each so TRL's mean over processes weighs them by count, and this process's count.
    Raises UnsupportedTrainerConfig when this TRL has no ``_calculate_rewards``."""
    original = getattr(trainer, "_calculate_rewards", None)
    if original is None:
        raise UnsupportedTrainerConfig(
            "this TRL version has no GRPOTrainer._calculate_rewards to read the rewards from; pass log_metrics=False "
            "(trl>=1.16 tested)"
        )

    def with_split(inputs, prompts, *a, **kw):
        rewards_per_func = original(inputs, prompts, *a, **kw)
        result = spec.last_result
        if trainer.model.training and result is not None and len(result.response_ids) == len(prompts):
            start = trainer.accelerator.process_index * len(prompts)
            local = weighted_rewards(trainer, rewards_per_func[start : start + len(prompts)])
            origins = response_origins(result)
            sums = origin_sums(origins, local)
            for origin in ORIGINS:
                trainer._log_metric(f"spec_rl/count_{origin}", float(sums[f"count_{origin}"]))
            for origin, reward in zip(origins, local):
                if reward == reward:  # not NaN: TRL leaves unscored rows out of its reward too
                    trainer._log_metric(f"spec_rl/reward_{origin}", float(reward))
        return rewards_per_func

    trainer._calculate_rewards = with_split
    trainer._spec_rl_reward_hook = True
