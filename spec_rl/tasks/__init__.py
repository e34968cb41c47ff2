"""Tasks: data loaders, rewards, held-out evaluation, the procedurally generated demo task and its policy.
Layer 8: may import util .. rollout (evaluation generates with a backend).

``spec_rl.tasks.arithmetic`` generates multi-step arithmetic word problems in
GSM8K answer format; ``spec_rl.tasks.demo_policy`` trains (once, cached) the
small transformers policy of the default demo job from its parts:
``demo_data`` (problem sets), ``demo_config`` (what shapes the checkpoint),
``demo_tokenizer`` and ``demo_sft`` (model and warm-start). The demo-policy
names are imported lazily, so ``import spec_rl.tasks`` does not import
transformers.
"""

from __future__ import annotations

from .arithmetic import TASK_VERSION, check_solution, generate_problems

__all__ = [
    "TASK_VERSION",
    "check_solution",
    "generate_problems",
    # lazily imported from .demo_policy:
    "DemoConfig",
    "build_demo_policy",
    "demo_eval_set",
    "demo_train_set",
    "evaluate_policy",
]

_DEMO_NAMES = {"DemoConfig", "build_demo_policy", "demo_eval_set", "demo_train_set", "evaluate_policy"}


def __getattr__(name: str):
    if name in _DEMO_NAMES:
        from . import demo_policy

        return getattr(demo_policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
