"""Small statistics for honest comparisons (pure): Wilson intervals (also at an effective sample size for
mean@k), exact McNemar, paired bootstrap, pass@k."""

from __future__ import annotations

import math
import random


def wilson(successes: float, n: float, z: float = 1.959963984540054) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion (95% by default); (0, 1) for n = 0. ``n`` may be an
    effective (non-integer) sample size, with ``successes`` = proportion * n."""
    if n <= 0:
        return 0.0, 1.0
    return _wilson_at(successes / n, n, z)


def _wilson_at(p: float, n: float, z: float = 1.959963984540054) -> tuple[float, float]:
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(max(p * (1 - p), 0.0) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def mcnemar_exact(b: int, c: int) -> float:
    """Two-sided exact McNemar p-value from the discordant counts (b: A right / B wrong, c: the reverse)."""
    n = b + c
    if n == 0:
        return 1.0
    k = min(b, c)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def _groups(n: int, clusters: list | None) -> list[list[int]]:
    """The indices 0..n-1 grouped by equal ``clusters`` keys (first appearance order); each its own without."""
    if clusters is None:
        return [[i] for i in range(n)]
    if len(clusters) != n:
        raise ValueError(f"{len(clusters)} cluster keys for {n} examples")
    groups: dict = {}
    for i, c in enumerate(clusters):
        groups.setdefault(c, []).append(i)
    return list(groups.values())


def paired_bootstrap(a: list[float], b: list[float], iters: int = 2000, seed: int = 0,
                     clusters: list | None = None) -> dict:
    """Mean difference b - a with a 95% percentile interval, resampling examples, or with ``clusters`` (one key
    per example: examples with equal keys, such as repeats of one prompt, are not independent) resampling the
    clusters whole (each resample's mean difference over the examples it holds); widened where needed to cover
    Newcombe's paired interval (:func:`_newcombe_paired`), so it never collapses to zero width."""
    if len(a) != len(b) or not a:
        raise ValueError("paired bootstrap needs two equally long non-empty lists")
    rng = random.Random(seed)
    n = len(a)
    diffs = [y - x for x, y in zip(a, b)]
    groups = _groups(n, clusters)
    sums, sizes = [sum(diffs[i] for i in g) for g in groups], [len(g) for g in groups]
    c = len(groups)
    means = []
    for _ in range(iters):
        picks = [rng.randrange(c) for _ in range(c)]
        means.append(sum(sums[j] for j in picks) / sum(sizes[j] for j in picks))
    means.sort()
    lo, hi = means[int(0.025 * iters)], means[int(0.975 * iters) - 1]
    # the percentile bootstrap collapses to zero width where every example differs alike (two evals that agree
    # everywhere: [0, 0]); never narrower than Newcombe's paired interval (review-b)
    nlo, nhi = _newcombe_paired(a, b, clusters)
    return {"mean_diff": sum(diffs) / n, "ci95": [min(lo, nlo), max(hi, nhi)]}


def _newcombe_paired(a: list[float], b: list[float], clusters: list | None = None) -> tuple[float, float]:
    """95% interval of mean(b) - mean(a) over paired examples (scores in [0, 1]) by Newcombe's method 10 (MOVER):
    each arm's Wilson interval (:func:`accuracy_ci`, repeats of a prompt as one cluster; mean@k scores at n, the
    conservative end) combined with Newcombe's continuity-corrected correlation of the paired scores (0 where it
    is undefined)."""
    n = len(a)
    pa, pb = sum(a) / n, sum(b) / n
    (la, ua), _ = accuracy_ci(a, 1, clusters=clusters)
    (lb, ub), _ = accuracy_ci(b, 1, clusters=clusters)
    va, vb = sum((x - pa) ** 2 for x in a), sum((y - pb) ** 2 for y in b)
    # Newcombe's corrected correlation: for 0/1 scores s = (n11 n00 - n10 n01) / n, and method 10 takes
    # (s - 1/2) / sqrt(va vb) where s > 1/2, 0 where 0 <= s <= 1/2 (the plain correlation: 1 for two evals that
    # agree everywhere, which collapsed the interval to zero width at p = 1/2)
    s = sum((x - pa) * (y - pb) for x, y in zip(a, b))
    r = 0.0 if va <= 0 or vb <= 0 or 0 <= s <= 0.5 else (s - 0.5 if s > 0.5 else s) / math.sqrt(va * vb)
    d = pb - pa
    lo = d - math.sqrt(max((pb - lb) ** 2 + (ua - pa) ** 2 - 2 * r * (pb - lb) * (ua - pa), 0.0))
    hi = d + math.sqrt(max((ub - pb) ** 2 + (pa - la) ** 2 - 2 * r * (ub - pb) * (pa - la), 0.0))
    return max(-1.0, lo), min(1.0, hi)


def cluster_effective_size(successes: list[float], trials: list[float]) -> float:
    """The number of independent Bernoulli trials that clusters of correlated trials are worth (cluster j:
    ``successes[j]`` right of ``trials[j]``): ``n_eff = p(1-p) / Var(p)`` with p = sum successes / sum trials
    and the ratio estimator's variance ``Var(p) = C/(C-1) * sum_j (s_j - p t_j)^2 / (sum t)^2`` over the C
    clusters, clamped to [n_kish, N]: N = sum t (every trial independent), n_kish = N^2 / sum t_j^2 (the
    trials within a cluster all alike: C for clusters of equal size). When p is 0 or 1, or C < 2, the
    correlation cannot be estimated: n_kish (conservative). Var(p) = 0 with 0 < p < 1: N."""
    c = len(trials)
    total = float(sum(trials))
    if c == 0 or total <= 0:
        return 0.0
    n_kish = total * total / sum(float(t) * t for t in trials)
    p = sum(float(x) for x in successes) / total
    if c < 2 or p <= 0.0 or p >= 1.0:
        return n_kish
    var = c / (c - 1) * sum((float(x) - p * t) ** 2 for x, t in zip(successes, trials)) / (total * total)
    if var <= 0.0:
        return total
    return min(max(p * (1 - p) / var, n_kish), total)


def effective_sample_size(per_example: list[float], k: int) -> float:
    """The number of independent Bernoulli trials the n*k samples are worth, for mean@k scores (each of the n
    examples scored as the fraction of its k samples that are right): ``n_eff = p(1-p) n / s^2`` with p the
    mean score and s^2 the sample variance (ddof = 1) of the per-example scores (the variance of the mean,
    s^2 / n, set equal to a binomial's p(1-p) / n_eff), clamped to [n, n*k] (no more than the samples, no fewer
    than the examples). When p is 0 or 1 (or there is a single example) the correlation of an example's samples
    cannot be estimated: n_eff = n (conservative). s^2 = 0 with 0 < p < 1 (every example the same fraction):
    n*k. For k = 1 the scores are 0/1, s^2 = p(1-p) n / (n-1), and n_eff is n."""
    return cluster_effective_size([float(x) * k for x in per_example], [k] * len(per_example))


def accuracy_ci(per_example: list[float], k: int = 1, z: float = 1.959963984540054, clusters: list | None = None
                ) -> tuple[tuple[float, float], str]:
    """95% interval of an accuracy from per-example scores (``k`` samples per example; mean@k scores in
    [0, 1] for k > 1, right/wrong for k = 1), and the method used: a Wilson score interval at the observed mean
    over the effective sample size of :func:`effective_sample_size` (the k samples of one example are
    correlated, so n*k samples treated as independent would give too narrow an interval). For k = 1 it is
    exactly the Wilson interval over the n examples. Unlike a percentile bootstrap over examples it never
    collapses to zero width (all-0 or all-1 scores: Wilson on n; one success among many examples: a Wilson
    upper bound, not the bootstrap's handful of resamples).

    ``clusters`` (one key per example, e.g. its prompt): examples with equal keys are scored together as one
    cluster of :func:`cluster_effective_size` (a generated task can repeat a question; greedy answers to a
    repeat are copies, not new trials). Without repeats this is the interval above."""
    n = len(per_example)
    if n == 0:
        return (0.0, 1.0), "none (no examples)"
    if k < 1:
        raise ValueError(f"k (samples per example) must be >= 1, got {k}")
    groups = _groups(n, clusters)
    if len(groups) < n:
        succ = [sum(float(per_example[i]) * k for i in g) for g in groups]
        n_eff = cluster_effective_size(succ, [len(g) * k for g in groups])
        p = sum(succ) / (n * k)
        return _wilson_at(p, n_eff, z), (
            f"Wilson score, 95%, at the effective sample size n_eff = {n_eff:.4g} of {n} examples x {k} samples "
            f"in {len(groups)} distinct prompts (repeats of a prompt scored as one cluster: n_eff = p(1-p)/Var(p), "
            "Var(p) from the between-cluster variance, clamped to [N^2/sum size^2, N]; the lower end when p is 0 or 1)")
    if k == 1:
        return wilson(sum(float(x) for x in per_example), n, z), "Wilson score, 95%, over examples"
    p = sum(float(x) for x in per_example) / n
    n_eff = effective_sample_size(per_example, k)
    return _wilson_at(p, n_eff, z), (
        f"Wilson score, 95%, at the effective sample size n_eff = {n_eff:.4g} of {n} examples x {k} samples "
        "(n_eff = p(1-p)n/s^2 from the between-example variance, clamped to [n, nk]; n when p is 0 or 1)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct (Chen et al. 2021); k <= n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
