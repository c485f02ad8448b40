"""GRPO / DAPO math (DESIGN §4): group advantages, the clipped surrogate, reward shaping and the AQN schedule.

Pure functions on tensors; no I/O, no model, no distributed calls. Where a quantity must be normalized over
more rows than one call sees (several minibatches, several ranks), the caller passes the global denominator.

Rows are group-major: row ``i * G + j`` is sample ``j`` of prompt ``i``.
"""

from __future__ import annotations

import math

import torch

ADV_SCALES = ("group", "none", "batch")
AGGREGATIONS = ("token", "sequence")


# ------------------------------------------------------------------------------------------ advantages
def informative_groups(rewards: torch.Tensor, group: int) -> torch.Tensor:
    """``[B]`` bool: the group's rewards are not all equal (it carries a learning signal; what dynamic sampling
    keeps). With shaping (format reward, overlong penalty) an all-wrong group can qualify: see
    :func:`mixed_outcome_groups` for the success/failure view."""
    r = rewards.reshape(-1, group)
    return r.max(1).values != r.min(1).values


def mixed_outcome_groups(correct: torch.Tensor, group: int) -> torch.Tensor:
    """``[B]`` bool: the group holds both a correct and a not-correct sample (DESIGN's informative group)."""
    c = correct.reshape(-1, group).bool()
    return c.any(1) & ~c.all(1)


def group_advantages(rewards: torch.Tensor, group: int, scale: str = "group", eps: float = 1e-6,
                     batch_std: float | None = None) -> torch.Tensor:
    """Per-row advantages ``A_i = (R_i - mean_g) / (std_g + eps)`` with the **population** std of the group.

    ``scale='none'``: ``R_i - mean_g`` (no std scaling, Dr. GRPO); ``scale='batch'``: ``(R_i - mean_g) /
    (std_batch + eps)`` with the population std of all rewards of the batch (``batch_std`` overrides it, e.g.
    the std over every rank). Rows of all-equal groups get exactly 0."""
    if scale not in ADV_SCALES:
        raise ValueError(f"advantage scale must be one of {ADV_SCALES}, got '{scale}'")
    if rewards.numel() % group:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group}")
    r = rewards.double().reshape(-1, group)
    centered = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = centered / (r.std(1, unbiased=False, keepdim=True) + eps)
    elif scale == "batch":
        s = float(r.std(unbiased=False)) if batch_std is None else batch_std
        adv = centered / (s + eps)
    else:
        adv = centered
    adv = torch.where(informative_groups(rewards, group)[:, None], adv, torch.zeros_like(adv))
    return adv.reshape(-1).to(torch.float32)


# ------------------------------------------------------------------------------------------ rewards and masks
def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward: 0 up to ``max_len - buffer`` tokens, then linear
    down to ``-factor`` at ``max_len`` (and beyond). ``buffer = 0`` turns it off."""
    lengths = lengths.float()
    if buffer <= 0:
        return torch.zeros_like(lengths)
    start = max_len - buffer
    pen = (start - lengths) / buffer * factor
    return torch.where(lengths <= start, torch.zeros_like(lengths), pen.clamp(min=-factor))


def loss_mask(completion_mask: torch.Tensor, truncated: torch.Tensor, mask_truncated: bool) -> torch.Tensor:
    """The tokens that enter the loss: generated tokens, minus whole truncated completions when asked
    (DAPO overlong filtering: a cut-off completion says nothing reliable about its answer)."""
    m = completion_mask.bool()
    if mask_truncated:
        m = m & ~truncated.bool()[:, None]
    return m


# ------------------------------------------------------------------------------------------ the loss
def importance_ratio(logp: torch.Tensor, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """``exp(logp - behaviour_logp)``; exactly 1 where the two are equal."""
    return torch.exp(logp - behaviour_logp)


def denominator(mask: torch.Tensor, aggregation: str) -> float:
    """What a minibatch contributes to the loss normalizer: its loss tokens (token-level) or its sequences
    that have any loss token (sequence-level). Sum it over minibatch parts / ranks for the global one."""
    if aggregation == "token":
        return float(mask.sum())
    return float((mask.sum(1) > 0).sum())


def clipped_surrogate(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor,
                      mask: torch.Tensor, eps_low: float = 0.2, eps_high: float = 0.28,
                      aggregation: str = "token", denom: float | None = None) -> tuple[torch.Tensor, dict]:
    """PPO/GRPO clipped surrogate with separate clip bounds (DAPO clip-higher):

    per token ``l = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with ``r = exp(logp - behaviour_logp)``.

    ``aggregation='token'``: ``sum(l * mask) / denom`` (denom = loss tokens, DAPO); ``'sequence'``: each
    sequence's token mean, summed, ``/ denom`` (denom = sequences, GRPO). ``denom`` defaults to this call's own
    count; pass the global count when the batch is split over minibatches or ranks.

    Returns the loss and detached statistics (sums and extremes, so callers can combine them)."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got '{aggregation}'")
    m = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)[:, None]
    ratio = importance_ratio(logp, behaviour_logp.to(logp.dtype))
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    d = denom if denom is not None else denominator(mask, aggregation)
    d = max(d, 1.0)
    if aggregation == "token":
        loss = (per_token * m).sum() / d
    else:
        loss = ((per_token * m).sum(1) / m.sum(1).clamp(min=1)).sum() / d
    with torch.no_grad():
        mb = mask.bool()
        r = ratio.detach()[mb]
        a = adv.expand_as(ratio)[mb]
        low = (a < 0) & (r < 1 - eps_low)  # the clip is active (gradient zero) below the low bound
        high = (a > 0) & (r > 1 + eps_high)
        stats = {"tokens": int(mb.sum()),
                 "ratio_sum": float(r.sum()), "ratio_min": float(r.min()) if r.numel() else 1.0,
                 "ratio_max": float(r.max()) if r.numel() else 1.0,
                 "clip_low": int(low.sum()), "clip_high": int(high.sum())}
    return loss, stats


# ------------------------------------------------------------------------------------------ schedules
def aqn_sigma(step: int, total_steps: int, sigma_start: float, sigma_end: float, stages: int) -> float:
    """The AQN sigma at 0-based ``step`` of ``total_steps``: ``stages`` equal stages, stage 0 has sigma 0,
    stages 1..K-1 go geometrically from ``sigma_start`` to ``sigma_end`` (both attained). K = 1 means no
    noise; K = 2 has one noisy stage at ``sigma_start``."""
    if stages < 1 or total_steps < 1:
        raise ValueError("the AQN schedule needs stages >= 1 and total_steps >= 1")
    if not 0 <= step < total_steps:
        raise ValueError(f"step {step} is outside 0..{total_steps - 1}")
    stage = min(step * stages // total_steps, stages - 1)
    if stage == 0:
        return 0.0
    if stages == 2:
        return float(sigma_start)
    if sigma_start <= 0 or sigma_end <= 0:
        raise ValueError("a geometric AQN schedule needs sigma_start > 0 and sigma_end > 0")
    frac = (stage - 1) / (stages - 2)
    return float(sigma_start * (sigma_end / sigma_start) ** frac)


def aqn_schedule(total_steps: int, sigma_start: float, sigma_end: float, stages: int) -> list[float]:
    return [aqn_sigma(s, total_steps, sigma_start, sigma_end, stages) for s in range(total_steps)]


def lr_at(step: int, total_steps: int, lr: float, warmup_steps: int, min_lr_ratio: float = 0.0) -> float:
    """Linear warm-up over ``warmup_steps`` (0-based ``step``: the first step uses ``lr / warmup``), then
    cosine decay towards ``lr * min_lr_ratio``, reached just after the last step (as HF's cosine schedule):
    the last step still learns, so its rollout is not spent at lr 0."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    rest = max(total_steps - warmup_steps, 1)
    progress = min(max(step - warmup_steps, 0) / rest, 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
