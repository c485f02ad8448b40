"""grpo: advantages, clipped losses, masks, penalties and schedules against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_cli import grpo

S3 = math.sqrt(3)


def test_group_advantages_hand_computed():
    a = grpo.group_advantages(torch.tensor([1.0, 0, 0, 0]), 4)
    assert torch.allclose(a, torch.tensor([S3, -1 / S3, -1 / S3, -1 / S3]), atol=1e-5)
    # two groups, the second all-equal: exactly zero
    a = grpo.group_advantages(torch.tensor([1.0, 0, 0, 0, 0.7, 0.7, 0.7, 0.7]), 4)
    assert torch.equal(a[4:], torch.zeros(4))
    assert grpo.informative_groups(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1]), 4).tolist() == [True, False]
    # no std scaling: centered only
    a = grpo.group_advantages(torch.tensor([1.0, 0, 0, 0]), 4, scale="none")
    assert torch.allclose(a, torch.tensor([0.75, -0.25, -0.25, -0.25]))
    # batch scaling: population std of the whole batch (rewards 1,0,0,0,1,1,0,0 -> std 0.484...)
    r = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    a = grpo.group_advantages(r, 4, scale="batch")
    std = math.sqrt(3 / 8 * 5 / 8)
    assert torch.allclose(a, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]) / std, atol=1e-5)
    assert torch.allclose(grpo.group_advantages(r, 4, scale="batch", batch_std=2.0),
                          torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]) / 2, atol=1e-5)
    with pytest.raises(ValueError):
        grpo.group_advantages(torch.zeros(5), 4)


def test_clipped_surrogate_hand_computed():
    # one token per row; ratios 1.5 (A=+1, clipped at 1.28), 0.5 (A=-1, clipped at 0.8), 1.1 (A=+1, inside)
    blp = torch.zeros(3, 1)
    logp = torch.log(torch.tensor([[1.5], [0.5], [1.1]]))
    adv = torch.tensor([1.0, -1.0, 1.0])
    mask = torch.ones(3, 1, dtype=torch.bool)
    loss, st = grpo.clipped_surrogate(logp, blp, adv, mask, 0.2, 0.28, "token")
    # -min(rA, clip(r)A): row0 -min(1.5, 1.28) = -1.28; row1 -min(-0.5, -0.8) = 0.8; row2 -1.1
    assert loss.item() == pytest.approx((-1.28 + 0.8 - 1.1) / 3, rel=1e-6)
    assert st["clip_high"] == 1 and st["clip_low"] == 1 and st["tokens"] == 3
    assert st["ratio_min"] == pytest.approx(0.5) and st["ratio_max"] == pytest.approx(1.5)
    # symmetric clip (GRPO eps 0.2): row0 clipped at 1.2
    loss, _ = grpo.clipped_surrogate(logp, blp, adv, mask, 0.2, 0.2, "token")
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1) / 3, rel=1e-6)
    # gradient is zero through clipped tokens, -A/... through the unclipped one
    lp = logp.clone().requires_grad_(True)
    grpo.clipped_surrogate(lp, blp, adv, mask, 0.2, 0.28, "token")[0].backward()
    assert lp.grad[0, 0] == 0 and lp.grad[1, 0] == 0
    assert lp.grad[2, 0].item() == pytest.approx(-1.1 / 3, rel=1e-6)


def test_aggregation_and_denominators():
    logp = torch.zeros(2, 3)
    blp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    # per-token loss -A: row0 -1 x3, row1 +2 x1
    tok, _ = grpo.clipped_surrogate(logp, blp, adv, mask, aggregation="token")
    assert tok.item() == pytest.approx((-3 + 2) / 4)
    seq, _ = grpo.clipped_surrogate(logp, blp, adv, mask, aggregation="sequence")
    assert seq.item() == pytest.approx((-1 + 2) / 2)
    assert grpo.denominator(mask, "token") == 4 and grpo.denominator(mask, "sequence") == 2
    # a global denominator (another minibatch / rank holds 4 more tokens)
    tok8, _ = grpo.clipped_surrogate(logp, blp, adv, mask, aggregation="token", denom=8)
    assert tok8.item() == pytest.approx(-1 / 8)


def test_ratio_exactly_one_when_logprobs_equal():
    lp = torch.randn(4, 7)
    r = grpo.importance_ratio(lp, lp.clone())
    assert torch.equal(r, torch.ones_like(r))
    _, st = grpo.clipped_surrogate(lp, lp.clone(), torch.randn(4), torch.ones(4, 7, dtype=torch.bool))
    assert st["ratio_min"] == 1.0 and st["ratio_max"] == 1.0 and st["clip_low"] == st["clip_high"] == 0


def test_truncation_mask_and_overlong_penalty():
    cm = torch.ones(3, 4, dtype=torch.bool)
    m = grpo.loss_mask(cm, torch.tensor([False, True, False]), mask_truncated=True)
    assert m.sum(1).tolist() == [4, 0, 4]
    assert grpo.loss_mask(cm, torch.tensor([False, True, False]), mask_truncated=False).all()
    pen = grpo.overlong_penalty(torch.tensor([10, 12, 14, 16, 20]), max_len=16, buffer=4, factor=1.0)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.5, -1.0, -1.0]))
    assert torch.equal(grpo.overlong_penalty(torch.tensor([16]), 16, 0), torch.zeros(1))


def test_aqn_schedule_endpoints():
    s = grpo.aqn_schedule(100, 1e-2, 5e-4, 10)
    assert s[:10] == [0.0] * 10  # stage 0
    assert s[10] == pytest.approx(1e-2) and s[19] == pytest.approx(1e-2)
    assert s[-1] == pytest.approx(5e-4) and s[90] == pytest.approx(5e-4)
    stages = sorted(set(s), reverse=True)
    assert len(stages) == 10
    ratios = [stages[i + 1] / stages[i] for i in range(1, 8)]
    assert all(r == pytest.approx(ratios[0]) for r in ratios)  # geometric
    assert grpo.aqn_schedule(3, 0.1, 0.001, 3) == [0.0, pytest.approx(0.1), pytest.approx(0.001)]
    assert grpo.aqn_schedule(4, 0.1, 0.001, 1) == [0.0] * 4
    assert set(grpo.aqn_schedule(4, 0.1, 0.001, 2)) == {0.0, 0.1}
    with pytest.raises(ValueError):
        grpo.aqn_sigma(5, 5, 0.1, 0.01, 3)


def test_lr_schedule():
    assert grpo.lr_at(0, 10, 1.0, 2) == 0.5 and grpo.lr_at(1, 10, 1.0, 2) == 1.0
    assert grpo.lr_at(2, 10, 1.0, 2) == pytest.approx(1.0)
    # cosine over the 8 steps after warm-up, reaching the floor just after the last one
    assert grpo.lr_at(9, 10, 1.0, 2, min_lr_ratio=0.1) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert [grpo.lr_at(s, 4, 1.0, 0) for s in range(4)] == pytest.approx([1.0, 0.853553, 0.5, 0.146447], abs=1e-6)


def test_shaped_rewards_vary_without_mixed_outcomes():
    """A format reward makes an all-wrong group's rewards unequal (dynamic sampling keeps it, advantages are
    non-zero) but it has no success: DESIGN's informative-group fraction counts it as not informative."""
    rewards = torch.tensor([0.1, 0, 0, 0, 1.1, 0, 0, 0, 1.0, 1.0, 1.0, 1.0])
    correct = torch.tensor([False] * 4 + [True, False, False, False] + [True] * 4)
    assert grpo.informative_groups(rewards, 4).tolist() == [True, True, False]
    assert grpo.mixed_outcome_groups(correct, 4).tolist() == [False, True, False]


@pytest.mark.parametrize("steps,stages", [(4, 3), (10, 10), (11, 10), (150, 10), (7, 4)])
def test_schedule_attains_both_endpoints_whenever_steps_cover_the_stages(steps, stages):
    sched = grpo.aqn_schedule(steps, 1e-2, 5e-4, stages)
    assert sched[0] == 0.0 and sched[-1] == pytest.approx(5e-4)
    assert 1e-2 in sched
    assert len(set(sched)) == stages  # every stage gets at least one step
