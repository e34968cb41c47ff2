"""Exact acceptance on a server: the token at a rejection comes from the residual (docs/design.md "Exact acceptance").

A server cannot exclude the rejected draft token y_n, so the continuation is resent under the next seed while it
begins with y_n; the first that does not is a residual token plus a fresh continuation of pi_t (cost and attempt
bound: docs/integrations.md)."""

from __future__ import annotations

import warnings
from collections.abc import Awaitable, Callable
from typing import Any

from ..sampling.philox import SEED_SALT_RESIDUAL, mix_seed

#: Continuation attempts at one rejection before :func:`draw_continuation` gives up.
MAX_RESIDUAL_ATTEMPTS = 16

_SEED_MASK = (1 << 63) - 1  # servers take a signed 64-bit seed


def residual_seeds(step_seed: int, uid: int, attempts: int = MAX_RESIDUAL_ATTEMPTS) -> list[int]:
    """Server seeds (in [0, 2**63)) of one sample's continuation attempts: a pure function of (step seed, uid,
    attempt), salted apart from the acceptance uniforms, so a rollout replays."""
    key = mix_seed(int(step_seed) ^ SEED_SALT_RESIDUAL, int(uid))
    return [mix_seed(key, a) & _SEED_MASK for a in range(int(attempts))]


async def draw_continuation(
    request: Any, send: Callable[[int | None], Awaitable[Any]], nothing: Any = None
) -> tuple[Any, int]:
    """Send a continuation; after a rejection that excludes y_n, resend under the next seed while it starts with y_n.

    ``request``: a :class:`~spec_rl.integrations.request_types.ContinuationRequest`, or None (nothing is sent:
    returns ``(nothing, 0)``). ``send(seed)`` (seed None: the server's own randomness) returns a tuple whose first
    element is the list of new token ids. Returns (what the accepted ``send`` returned, attempts discarded before it).
    With ``request.keep_last`` (lenient without-draft draw) the last attempt is kept when all began with y_n
    (RuntimeWarning) and ``request.kept_excluded`` is set: pass it to ``assemble(kept_excluded=...)``. Raises
    RuntimeError when every attempt began with y_n and ``keep_last`` is off (exact acceptance)."""
    if request is None:
        return nothing, 0
    excluded = request.excluded
    if excluded is None:
        return await send(None), 0
    out = None
    for attempt, seed in enumerate(request.seeds):
        out = await send(int(seed))
        tokens = out[0]
        if not tokens or int(tokens[0]) != int(excluded):
            return out, attempt
    lp = request.excluded_logprob
    where = "" if lp is None else f" (the policy gives it log-prob {lp:.4g} there)"
    if request.keep_last and out is not None:
        # Not lossless anyway: on a peaked policy keep the paper's draw at n rather than stop the run.
        warnings.warn(
            f"the without-draft draw kept a continuation that begins with the rejected token {excluded} after "
            f"{len(request.seeds)} attempts{where}; counted in spec_rl/draw_fallbacks (raise max_resample_attempts "
            "to make this rarer)",
            RuntimeWarning,
            stacklevel=2,
        )
        request.kept_excluded = True
        return out, len(request.seeds) - 1
    raise RuntimeError(
        f"the server sampled the rejected draft token {excluded} first in all {len(request.seeds)} continuation "
        f"attempts{where}, so no draw without it was obtained; raise max_resample_attempts, or use a lenient "
        "mode with the paper's draw (mode: spec, or l=1)"
    )
