"""``spec-rl train`` with a test reward, run in a subprocess by tests/trainer/test_crash_safety.py (which kills it).

The reward pays responses whose text contains the gold answer, so a tiny random policy gets groups with signal and
its weights change every step (the math reward never pays it: all advantages 0).

``KILL_AT="<point>[@<n>]"`` kills this process with SIGKILL at the n-th (default first) hit of a named point, so the
disk holds exactly what ``kill -9`` there leaves; the points are wrapped around the library from here:
``step.end`` (a step's metrics line appended), ``checkpoint.files`` (model, optimizer, cache and history written;
trainer state and marker not), ``checkpoint.marked`` (marker written, ``LATEST`` not moved), ``checkpoint.committed``
(``LATEST`` moved, old versions kept), ``write:<file name>`` (an atomic write's temporary written, not renamed).
"""

import functools
import os
import signal
import sys
from pathlib import Path

from spec_rl.cli import main
from spec_rl.tasks import rewards
from spec_rl.trainer import checkpoint, grpo
from spec_rl.util import atomic

_hits: dict[str, int] = {}


def gold_word_reward(text: str, gold: str) -> float:
    return 1.0 if gold in text else 0.0


def hit(point: str) -> None:
    """Kill this process if ``KILL_AT`` arms ``point`` and this is the armed hit."""
    name, _, nth = os.environ.get("KILL_AT", "").partition("@")
    if name and name == point:
        _hits[point] = _hits.get(point, 0) + 1
        if _hits[point] >= int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)


def arm() -> None:
    """Wrap the library's steps at the named points."""
    step = grpo.GRPOTrainer.train_step

    @functools.wraps(step)
    def train_step(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        hit("step.end")
        return out

    grpo.GRPOTrainer.train_step = train_step
    write = checkpoint.atomic_write_text

    def checkpoint_write(path, *args, **kwargs):
        name = Path(path).name
        hit({checkpoint.STATE_FILE: "checkpoint.files", checkpoint.POINTER: "checkpoint.marked"}.get(name, ""))
        out = write(path, *args, **kwargs)
        hit("checkpoint.committed" if name == checkpoint.POINTER else "")
        return out

    checkpoint.atomic_write_text = checkpoint_write
    replace = os.replace

    def atomic_replace(src, dst, *args, **kwargs):
        if atomic.is_leftover(src):  # an atomic write's temporary, about to be renamed
            hit(f"write:{Path(dst).name}")
        return replace(src, dst, *args, **kwargs)

    os.replace = atomic_replace


if __name__ == "__main__":
    rewards.REWARD_FUNCTIONS["gold_word"] = gold_word_reward
    arm()
    sys.exit(main(sys.argv[1:]))
