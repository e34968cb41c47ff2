"""Exact (lossless) acceptance in the adapters: its options, and the residual draw on a server.

``acceptance="exact"`` (docs/design.md "Exact acceptance") accepts draft token y_i with probability
pi_t(y_i | x, y_<i) (``log u_i <= lp_new_i`` with keyed uniforms) and
draws the token at the first rejection n from the *residual*: pi_t(. | x, y_<n) without y_n,
renormalised. The response is then distributed exactly as a fresh sample of pi_t. The old log-probs
and the lenience play no part, so exact acceptance takes no lenience, and the random-reuse ablation
(which ignores the scores) has no exact form.

**The residual on a server.** A server samples from pi_t; it cannot be asked for "pi_t without
y_n". The continuation request after [x, y_<n] is therefore sent with a sampling seed, and when the
first token it returns is y_n it is sent again under the next seed (:func:`draw_continuation`),
up to a bounded number of attempts. This is exact: the attempts are independent draws of
(first token, rest) from pi_t, and the first one whose first token differs from y_n is a draw of
pi_t conditioned on "first token != y_n", i.e. a residual token followed by a fresh continuation of
pi_t. The seeds are a pure function of (run seed, step, sample uid, attempt)
(:func:`residual_seeds`), so a rollout replays exactly, and independent of the acceptance uniforms.

**What it costs.** With p = pi_t(y_n | x, y_<n), the attempts at a rejection are geometric: 1 / (1 - p)
continuation requests on average, i.e. p / (1 - p) extra ones (at most one extra when p <= 1/2).
Rejections at likely tokens are rare (probability 1 - p) but expensive, and averaged over the
acceptance test the extra requests per drafted sample come to E[n], the mean verified-prefix length:
one extra continuation request per accepted draft token. Each extra request prefills from the
server's prefix cache and decodes the whole continuation again. The attempt bound fails with
probability p ** attempts at that rejection (about 0.44 for p = 0.95 and 16 attempts), and then
:func:`draw_continuation` raises :class:`RuntimeError`. Lenient acceptance (the paper's rule) needs
none of this; its without-draft draw resends the same way but, not being lossless anyway, keeps the last
attempt when all of them began with y_n (the paper's draw there, counted) rather than stop the run. Tail speculation from history does not run on a server either: it needs a multi-token
verify inside the engine's decode loop (the in-process backends do it).
"""

from __future__ import annotations

import warnings
from collections.abc import Awaitable, Callable
from typing import Any

from ..sampling.philox import mix_seed

__all__ = ["MAX_RESIDUAL_ATTEMPTS", "draw_continuation", "residual_seeds"]

#: Continuation attempts at one rejection before :func:`draw_continuation` gives up.
MAX_RESIDUAL_ATTEMPTS = 16

_SEED_SALT_RESIDUAL = 0x7E51D0A1
_SEED_MASK = (1 << 63) - 1  # servers take a signed 64-bit seed


def residual_seeds(step_seed: int, uid: int, attempts: int = MAX_RESIDUAL_ATTEMPTS) -> list[int]:
    """Server sampling seeds of the continuation attempts of one sample, in order.

    A pure function of (step seed, uid, attempt), salted apart from the acceptance uniforms.

    Example
    -------
    >>> s = residual_seeds(mix_seed(0, 3), uid=12345, attempts=4)
    >>> len(set(s)) == 4 and all(0 <= x < 2**63 for x in s)
    True
    """
    key = mix_seed(int(step_seed) ^ _SEED_SALT_RESIDUAL, int(uid))
    return [mix_seed(key, a) & _SEED_MASK for a in range(int(attempts))]


async def draw_continuation(
    request: Any, send: Callable[[int | None], Awaitable[Any]], nothing: Any = None
) -> tuple[Any, int]:
    """Send a continuation; after a rejection that excludes y_n (exact acceptance, without-draft draw), resend
    under the next seed while it starts with y_n.

    Parameters
    ----------
    request : ContinuationRequest or None
        From :meth:`SpecRequestBuilder.continuation <spec_rl.integrations.requests.SpecRequestBuilder.continuation>`;
        its ``excluded`` token (None: one request, no seed), ``seeds`` (one per attempt, which bounds
        them) and ``excluded_logprob`` (quoted in the error). None: nothing is sent.
    send : async callable
        ``send(seed)`` sends the continuation under ``seed`` (None: the server's own randomness)
        and returns a tuple whose first element is the list of new token ids.
    nothing : any
        Returned (with 0) when ``request`` is None.

    Returns
    -------
    (out, resamples)
        What the accepted ``send`` returned, and how many attempts before it were discarded. When every
        attempt began with the excluded token and ``request.keep_last`` (the lenient without-draft draw),
        the last attempt is kept (the paper's draw at n, RuntimeWarning) and ``request.kept_excluded`` set:
        pass it to ``assemble(kept_excluded=...)``.

    Raises
    ------
    RuntimeError
        Every attempt began with the excluded token (exact acceptance: no lossless draw was obtained).
    """
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
        # Lenient (not lossless anyway): a run must not die on a peaked policy; the kept attempt is a draw
        # of pi_t at n that gave y_n, i.e. the paper's rule there. Counted as draw_fallbacks.
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
        f"attempts{where}, so no draw without it was obtained; raise max_resample_attempts, or use "
        "acceptance='lenient' with the paper's rejection_draw='policy'"
    )
