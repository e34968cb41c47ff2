"""verl reward function for the embedded arithmetic task (``reward.custom_reward_function.path``).

verl's reward manager calls ``compute_score(data_source, solution_str, ground_truth, extra_info)``
per response; the score is spec-rl's own: 1.0 when the response's final ``#### n`` answer equals
the gold answer (``spec_rl.tasks.rewards.math_reward``), else 0.0.
"""

from __future__ import annotations

from spec_rl.tasks.rewards import math_reward


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    return float(math_reward(solution_str, str(ground_truth)))
