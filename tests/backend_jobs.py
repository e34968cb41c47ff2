"""The backend calls of the tests in the per-row form they were written in, as jobs (not a test module)."""

from spec_rl.backends.base import Continuation, Cut, Job


def generate(backend, contexts, budgets, settings, seed, *, uids=None, proposers=None) -> list[Continuation]:
    """``backend.generate`` of one fresh job per context (uid i unless ``uids``)."""
    uids = range(len(contexts)) if uids is None else uids
    proposers = [None] * len(contexts) if proposers is None else proposers
    jobs = [Job(b, u, list(c), proposer=p) for c, b, u, p in zip(contexts, budgets, uids, proposers)]
    return backend.generate(jobs, settings, seed)


def continue_rows(
    backend,
    scored,
    accepted_lens,
    first_tokens,
    budgets,
    settings,
    seed,
    extra_contexts=(),
    extra_budgets=(),
    *,
    uids=None,
    proposers=None,
    sources=None,
) -> list[Continuation]:
    """``backend.continue_from``: scored row i continues draft ``sources[i]`` (default i) after ``accepted_lens[i]``
    tokens with ``first_tokens[i]`` (None: the row is done, an empty result), then the extra contexts are decoded;
    one result per row, then per extra context."""
    rows = len(first_tokens)
    total = rows + len(extra_contexts)
    uids = list(range(total)) if uids is None else list(uids)
    proposers = [None] * total if proposers is None else list(proposers)
    sources = list(range(rows)) if sources is None else list(sources)
    jobs, where = [], []
    for i, (n, token, budget) in enumerate(zip(accepted_lens, first_tokens, budgets)):
        if token is not None:
            jobs.append(Job(budget, uids[i], cut=Cut(sources[i], n, token), proposer=proposers[i]))
            where.append(i)
    for k, (ctx, budget) in enumerate(zip(extra_contexts, extra_budgets)):
        jobs.append(Job(budget, uids[rows + k], list(ctx), proposer=proposers[rows + k]))
        where.append(rows + k)
    outs = backend.continue_from(scored, jobs, settings, seed)
    results = [Continuation([], [], "length") for _ in range(total)]
    for i, out in zip(where, outs):
        results[i] = out
    return results
