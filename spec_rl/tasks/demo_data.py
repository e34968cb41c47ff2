"""The demo's problem sets: fixed RL train and held-out sets, and the SFT target format. All come from
:func:`~spec_rl.tasks.arithmetic.generate_problems` with :data:`DEMO_TASK_OPTIONS` and fixed seeds, so the same prompts
recur every epoch, which is what lets drafts be reused."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .arithmetic import generate_problems
from .data import Example

#: Options of :func:`~spec_rl.tasks.arithmetic.generate_problems` used for all demo data (read-only).
DEMO_TASK_OPTIONS: Mapping[str, int] = MappingProxyType(
    {"min_steps": 2, "max_steps": 3, "max_value": 20, "max_operand": 9}
)

#: Response budget (tokens, EOS included) that fits every demo response.
DEMO_MAX_NEW_TOKENS = 160

#: Seeds of the train and eval sets (part of the demo cache key).
TRAIN_SEED = 1234
EVAL_SEED = 5678
_TRAIN_N = 256
#: The SFT set excludes these questions, so the size is part of the demo policy (docs/design.md "The demo recipe").
_EVAL_N = 640


def demo_train_set() -> list[Example]:
    """The demo's fixed RL train set: 256 problems (uids ``"arith:1234:<i>"``), the same every call."""
    return generate_problems(_TRAIN_N, seed=TRAIN_SEED, **DEMO_TASK_OPTIONS)


def demo_eval_set() -> list[Example]:
    """The fixed held-out set of the demo: 640 problems, none of whose questions is in :func:`demo_train_set`."""
    train_q = {e.question for e in demo_train_set()}
    return generate_problems(_EVAL_N, seed=EVAL_SEED, exclude=train_q, **DEMO_TASK_OPTIONS)


def demo_response(example: Example) -> str:
    """The SFT target response for ``example``: ``" " + solution`` (EOS is appended as a token id). Raises ValueError
    when ``example.solution`` is None."""
    if example.solution is None:
        raise ValueError(f"example {example.uid!r} has no solution; demo SFT needs worked solutions")
    return " " + example.solution
