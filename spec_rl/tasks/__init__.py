"""Tasks: data loaders, rewards, held-out evaluation, the procedurally generated demo task and its policy.

Layer 7: may import util .. rollout (evaluation generates with a backend). The demo-policy names (``_DEMO_NAMES``) are
imported lazily, so ``import spec_rl.tasks`` does not import transformers."""

from __future__ import annotations

from .arithmetic import TASK_VERSION, check_solution, generate_problems

_DEMO_NAMES = ("DemoConfig", "build_demo_policy", "demo_eval_set", "demo_train_set")
__all__ = ["TASK_VERSION", "check_solution", "generate_problems", *_DEMO_NAMES]


def __getattr__(name: str):
    if name in _DEMO_NAMES:
        from . import demo_policy

        return getattr(demo_policy, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
