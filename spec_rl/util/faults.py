"""Fault injection for crash tests (a testing hook): ``SPEC_RL_FAULT="<point>[@<n>]"`` kills the process with SIGKILL
at the n-th (default first) hit of that point, so the disk holds exactly what ``kill -9`` there would leave.
"""

from __future__ import annotations

import os
import signal

ENV = "SPEC_RL_FAULT"

_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Kill this process if ``SPEC_RL_FAULT`` arms point ``name`` and this is the armed hit; ValueError for a count
    that is not an integer >= 1. Points: ``step.end`` (a step's metrics line appended); ``checkpoint.files`` (model,
    optimizer, cache and history written; trainer state and marker not); ``checkpoint.marked`` (marker written,
    ``LATEST`` not moved); ``checkpoint.committed`` (``LATEST`` moved, old versions kept); ``write:<file name>``
    (:func:`~spec_rl.util.atomic.atomic_write` wrote the temporary, not renamed it)."""
    armed = os.environ.get(ENV)
    if not armed:
        return
    point, _, nth = armed.partition("@")
    if point != name:
        return
    if nth and not (nth.isdigit() and int(nth) >= 1):
        raise ValueError(f"{ENV}={armed!r}: the count after '@' must be an integer >= 1")
    _hits[name] = _hits.get(name, 0) + 1
    if _hits[name] >= int(nth or 1):
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))
