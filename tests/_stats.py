"""Chi-square goodness of fit for the distribution tests (no scipy needed)."""

import math

import torch

# Standard normal quantile at 1 - 1e-4: tests fail by chance about once in 10,000 runs per check.
_Z = 3.719


def chi2_critical(df: int, z: float = _Z) -> float:
    """Upper chi-square quantile by the Wilson-Hilferty approximation (accurate to ~1% for df >= 1)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of observed ``counts`` against ``probs``; zero-probability bins must be empty."""
    counts, probs = counts.double().flatten(), probs.double().flatten()
    expected = probs * counts.sum()
    keep = expected > 0
    assert int(counts[~keep].sum()) == 0, "an outcome of probability zero occurred"
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    return stat, int(keep.sum()) - 1


def assert_fits(counts: torch.Tensor, probs: torch.Tensor) -> None:
    """Assert the counts are a plausible sample of ``probs`` (chi-square, p = 1e-4)."""
    stat, df = chi2_stat(counts, probs)
    if df == 0:
        return
    crit = chi2_critical(df)
    assert stat < crit, (
        f"chi-square {stat:.1f} >= {crit:.1f} (df {df}): counts {counts.tolist()} vs probs {probs.tolist()}"
    )


def assert_same_distribution(a: torch.Tensor, b: torch.Tensor) -> None:
    """Two-sample chi-square homogeneity test on count vectors over the same bins (p = 1e-4)."""
    a, b = a.double().flatten(), b.double().flatten()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    na, nb = a.sum(), b.sum()
    pooled = (a + b) / (na + nb)
    stat = float((((a - na * pooled) ** 2) / (na * pooled) + ((b - nb * pooled) ** 2) / (nb * pooled)).sum())
    df = int(keep.sum()) - 1
    if df > 0:
        crit = chi2_critical(df)
        assert stat < crit, f"two-sample chi-square {stat:.1f} >= {crit:.1f} (df {df})"
