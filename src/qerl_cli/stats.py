"""Small statistics for honest comparisons (pure): Wilson intervals, exact McNemar, paired bootstrap, pass@k."""

from __future__ import annotations

import math
import random


def wilson(successes: float, n: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% by default); (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (b: A right / B wrong, c: the reverse)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def paired_bootstrap(a: list[float], b: list[float], iters: int = 2000, seed: int = 0) -> dict:
    """Mean difference b - a with a 95% percentile interval, resampling examples."""
    if len(a) != len(b) or not a:
        raise ValueError("paired bootstrap needs two equally long non-empty lists")
    rng = random.Random(seed)
    n = len(a)
    diffs = [y - x for x, y in zip(a, b)]
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(iters))
    return {"mean_diff": sum(diffs) / n, "ci95": [means[int(0.025 * iters)], means[int(0.975 * iters) - 1]]}


def accuracy_ci(per_example: list[float], iters: int = 4000, seed: int = 0) -> tuple[tuple[float, float], str]:
    """95% interval of an accuracy from per-example scores, and the method used. Binary scores (one sample per
    example): Wilson. Fractional scores (mean@k, k samples per example): a percentile bootstrap over examples,
    because the k samples of one example are correlated and a Wilson interval over all n*k samples would be
    too narrow."""
    n = len(per_example)
    if n == 0:
        return (0.0, 1.0), "none (no examples)"
    if all(isinstance(x, bool) for x in per_example):
        return wilson(sum(per_example), n), "Wilson score, 95%, over examples"
    rng = random.Random(seed)
    vals = [float(x) for x in per_example]
    means = sorted(sum(vals[rng.randrange(n)] for _ in range(n)) / n for _ in range(iters))
    return (means[int(0.025 * iters)], means[int(0.975 * iters) - 1]), \
        "percentile bootstrap over examples of the per-example mean@k, 95%"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
