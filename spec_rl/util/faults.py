"""Fault injection for crash tests: kill the process with SIGKILL at a named point (a testing hook).

Off unless the environment variable ``SPEC_RL_FAULT`` is set. ``SPEC_RL_FAULT="<point>"`` kills the
process the first time the code reaches ``<point>``; ``"<point>@<n>"`` the n-th time. The kill is
SIGKILL, so nothing runs after it (no ``finally``, no ``atexit``): the files on disk are exactly what a
``kill -9`` at that instant leaves. tests/trainer/test_crash_safety.py uses it to check that ``--resume``
recovers from each point.

Named points:

* ``step.end``: after a training step's line was appended to metrics.jsonl.
* ``checkpoint.files``: a checkpoint version's model, optimizer, cache and history files are written;
  its trainer state and completion marker are not.
* ``checkpoint.marked``: the version is complete (marker written) but the ``LATEST`` pointer still
  names the previous one.
* ``checkpoint.committed``: the pointer names the new version; older versions are not removed yet.
* ``write:<file name>``: :func:`spec_rl.util.atomic.atomic_write` wrote the complete temporary file of
  ``<file name>`` (e.g. ``write:rollout_cache.safetensors``) and has not renamed it yet.
"""

from __future__ import annotations

import os
import signal

#: The environment variable that arms a fault point.
ENV = "SPEC_RL_FAULT"

_hits: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL if ``SPEC_RL_FAULT`` arms ``name`` and this is the armed hit.

    Parameters
    ----------
    name : str
        The point reached, e.g. ``"checkpoint.marked"``.

    Raises
    ------
    ValueError
        ``SPEC_RL_FAULT`` names this point with a count that is not an integer >= 1.
    """
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
