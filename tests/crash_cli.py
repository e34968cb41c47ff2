"""``spec-rl train`` with a test reward, run in a subprocess by tests/trainer/test_crash_safety.py (which kills it).

The reward pays responses whose text contains the gold answer, so a tiny random policy gets groups
with signal and its weights change every step (the math reward never pays it: all advantages 0).
"""

import sys

from spec_rl.cli import main
from spec_rl.tasks import rewards


def gold_word_reward(text: str, gold: str) -> float:
    return 1.0 if gold in text else 0.0


if __name__ == "__main__":
    rewards.REWARD_FUNCTIONS["gold_word"] = gold_word_reward
    sys.exit(main(sys.argv[1:]))
