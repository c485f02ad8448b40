"""Tests of the AWQ-under-NVFP4 math (src/qerl_cli/awq.py): small hand-made cases, CPU, fast."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_cli import awq, nvfp4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _outlier_case(seed: int = 0, t: int = 256, k: int = 64, outlier: int = 5, mag: float = 40.0):
    """Activations with one channel ``mag`` times larger than the rest; a q/k/v-like fused set."""
    g = _gen(seed)
    x = torch.randn(t, k, generator=g)
    x[:, outlier] *= mag
    weights = [torch.randn(n, k, generator=g) * 0.05 for n in (32, 16, 16)]
    return x, weights


def _direct_rtn_error(x, weights):
    """The brief's formula, written out independently: one shared G, nvfp4.fake_quantize, output MSE."""
    g = nvfp4.fused_global_scale(weights)
    sse = sum(float(((x @ nvfp4.fake_quantize(w, g).t()) - x @ w.t()).double().square().sum()) for w in weights)
    return sse / (x.shape[0] * sum(w.shape[0] for w in weights))


def _direct_error(x, weights, s, ratios=None):
    """Brief's formula with scales (and clip ratios): (x/s) @ Q(W*s)^T - x @ W^T."""
    scaled = [w * s for w in weights]
    g = nvfp4.fused_global_scale(scaled)
    ratios = ratios or [1.0] * len(weights)
    sse = 0.0
    for w, ws, r in zip(weights, scaled, ratios):
        q = awq.clipped_fake_quantize(ws, g, r)
        sse += float(((x / s) @ q.t() - x @ w.t()).double().square().sum())
    return sse / (x.shape[0] * sum(w.shape[0] for w in weights))


# ----------------------------------------------------------------------------------------------- stats


def test_activation_stats_mean_abs_fp32_and_bf16():
    x = torch.tensor([[1.0, -2.0, 0.0], [-3.0, 2.0, 0.0]])
    s = awq.activation_stats(x)
    assert s.dtype == torch.float32
    assert torch.equal(s, torch.tensor([2.0, 2.0, 0.0]))
    s16 = awq.activation_stats(x.bfloat16())
    assert s16.dtype == torch.float32 and torch.equal(s16, s)
    # [B, L, K] is flattened over tokens
    assert torch.equal(awq.activation_stats(x.reshape(1, 2, 3)), s)


def test_scales_normalization_and_dead_channel():
    stats = torch.tensor([4.0, 1.0, 0.25, 0.0])
    s = awq.scales_from_stats(stats, 0.5)
    assert torch.isfinite(s).all() and (s > 0).all()
    # sqrt(max * min) == 1 after normalization
    assert math.isclose(float(s.max() * s.min()), 1.0, rel_tol=1e-5)
    assert int(s.argmax()) == 0 and int(s.argmin()) == 3  # dead channel clamped, not zero
    assert torch.equal(awq.scales_from_stats(stats, 0.0), torch.ones(4))


# ----------------------------------------------------------------------------------------------- search


def test_outlier_channel_gets_largest_scale_and_awq_beats_rtn():
    x, weights = _outlier_case()
    res = awq.search_scales(x, weights, awq.AWQConfig(clip_search=False))
    assert res.alpha > 0
    assert int(res.scales.argmax()) == 5
    assert res.scales.dtype == torch.float32 and res.scales.shape == (64,)
    assert res.error < res.error_rtn  # strictly better than round-to-nearest
    assert res.error == min(res.errors) and res.errors[0] == res.error_rtn
    assert len(res.errors) == 20 and res.alphas[0] == 0.0 and res.alphas[-1] == 0.95
    # the reported error is the brief's formula (same quantity, computed without cancellation)
    assert math.isclose(res.error, _direct_error(x, weights, res.scales), rel_tol=1e-4)
    assert math.isclose(res.error, awq.group_error(x, weights, res.scales), rel_tol=1e-9)
    # the shared global scale is the one of the scaled set
    assert torch.equal(res.global_scale, nvfp4.fused_global_scale([w * res.scales for w in weights]))


def test_alpha_zero_is_exactly_round_to_nearest():
    x, weights = _outlier_case(seed=1)
    res = awq.search_scales(x, weights, awq.AWQConfig(n_grid=1))
    assert res.alphas == [0.0] and res.alpha == 0.0
    assert torch.equal(res.scales, torch.ones(64))
    assert res.error == res.error_rtn
    assert res.error_rtn == awq.group_error(x, weights)  # bit-equal with the shared helper
    assert math.isclose(res.error_rtn, _direct_rtn_error(x, weights), rel_tol=1e-4)
    # the same RTN error is alpha=0 of a full search
    full = awq.search_scales(x, weights)
    assert full.error_rtn == res.error_rtn and full.error <= full.error_rtn


def test_alpha_ties_keep_the_smaller_alpha():
    # every channel has mean |x| == 1, so every alpha gives s == 1 exactly: all errors tie, alpha 0 must win
    g = _gen(9)
    x = torch.where(torch.rand(64, 32, generator=g) > 0.5, 1.0, -1.0)
    weights = [torch.randn(16, 32, generator=g)]
    res = awq.search_scales(x, weights, awq.AWQConfig(n_grid=5))
    assert len(set(res.errors)) == 1
    assert res.alpha == 0.0 and torch.equal(res.scales, torch.ones(32))


def test_block_scales_ratio_one_bit_exact_on_many_blocks():
    g = _gen(11)
    w = torch.randn(512, 256, generator=g) * torch.rand(512, 1, generator=g) ** 4  # widely varying block amax
    gs = nvfp4.global_scale(w.abs().amax())
    a = awq.clipped_block_scales(w, gs, 1.0).view(torch.uint8)
    assert torch.equal(a, nvfp4.block_scales(w, gs).view(torch.uint8))
    assert torch.equal(awq.clipped_block_scales(w, gs, torch.ones(512)).view(torch.uint8), a)


def test_search_is_deterministic_and_accepts_bf16():
    x, weights = _outlier_case(seed=2)
    xb = x.bfloat16()
    a = awq.search_scales(xb, [w.bfloat16() for w in weights])
    b = awq.search_scales(xb.float(), [w.bfloat16().float() for w in weights])
    assert a.alpha == b.alpha and a.errors == b.errors and torch.equal(a.scales, b.scales)


def test_token_subsampling_is_deterministic():
    x, weights = _outlier_case(seed=3, t=300)
    cfg = awq.AWQConfig(max_tokens=100, n_grid=4)
    a, b = awq.search_scales(x, weights, cfg), awq.search_scales(x, weights, cfg)
    assert a.n_tokens == 100 and a.errors == b.errors
    sub = awq.subsample_tokens(x, 100, 0)
    assert sub.shape == (100, 64) and torch.equal(sub, awq.subsample_tokens(x, 100, 0))
    assert a.error_rtn == awq.group_error(sub, weights)
    # statistics still use every token
    assert torch.equal(a.scales, awq.scales_from_stats(awq.activation_stats(x), a.alpha))


def test_search_rejects_bad_shapes():
    x, weights = _outlier_case()
    with pytest.raises(ValueError, match="expected"):
        awq.search_scales(x, [torch.zeros(4, 48)])
    with pytest.raises(ValueError, match="at least one"):
        awq.search_scales(x, [])
    with pytest.raises(ValueError, match="multiple of 16"):
        awq.search_scales(torch.ones(4, 8), [torch.ones(2, 8)])
    bad = x.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        awq.search_scales(bad, weights)


# ----------------------------------------------------------------------------------------------- folding


def test_fold_into_norm_keeps_function():
    g = _gen(4)
    x_hat = torch.randn(32, 64, generator=g)  # normalized hidden state
    norm_w = 1 + 0.1 * torch.randn(64, generator=g)
    weights = [torch.randn(n, 64, generator=g) for n in (32, 16)]
    s = awq.scales_from_stats(torch.rand(64, generator=g) * 10, 0.5)
    new_norm = awq.fold_into_norm(norm_w, s)
    for w, ws in zip(weights, awq.apply_scales_to_weights(weights, s)):
        torch.testing.assert_close((x_hat * new_norm) @ ws.t(), (x_hat * norm_w) @ w.t(), rtol=1e-5, atol=1e-4)


def test_fold_into_linear_output_keeps_function():
    g = _gen(5)
    h = torch.randn(32, 48, generator=g)
    up = torch.randn(64, 48, generator=g) * 0.1
    gate = torch.randn(64, 48, generator=g) * 0.1
    down = torch.randn(48, 64, generator=g) * 0.1
    s = awq.scales_from_stats(torch.rand(64, generator=g) * 10, 0.7)
    (down_s,) = awq.apply_scales_to_weights([down], s)
    up_s = awq.fold_into_linear_output(up, s)
    act = torch.nn.functional.silu(h @ gate.t())
    torch.testing.assert_close((act * (h @ up_s.t())) @ down_s.t(), (act * (h @ up.t())) @ down.t(),
                               rtol=1e-5, atol=1e-5)
    # plain v -> o (one value channel per o column), with a bias on v
    v, bv, o = torch.randn(64, 48, generator=g), torch.randn(64, generator=g), torch.randn(48, 64, generator=g)
    (o_s,) = awq.apply_scales_to_weights([o], s)
    out = (h @ awq.fold_into_linear_output(v, s).t() + awq.fold_into_norm(bv, s)) @ o_s.t()
    torch.testing.assert_close(out, (h @ v.t() + bv) @ o.t(), rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError):
        awq.fold_into_linear_output(v, s[:32])


# ----------------------------------------------------------------------------------------------- clipping


def _assert_same_q(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key].view(torch.uint8) if a[key].dtype == torch.float8_e4m3fn else a[key],
                           b[key].view(torch.uint8) if b[key].dtype == torch.float8_e4m3fn else b[key]), key


def test_clip_ratio_one_is_nvfp4_byte_for_byte():
    # DESIGN §3 test vector
    w = torch.tensor([[0.02 * i * (-1) ** i for i in range(32)]], dtype=torch.bfloat16)
    q = awq.clipped_quantize_weight(w, ratio=1.0)
    assert q["weight_packed"].numpy().tobytes().hex() == "90a2c3d4d5e6f6f7d5e5e6e6e6f7f7f7"
    _assert_same_q(q, nvfp4.quantize_weight(w))
    g = _gen(6)
    ws = [torch.randn(24, 64, generator=g) * 0.03, torch.randn(8, 64, generator=g)]
    ws[0][3, 16:32] = 0.0  # an all-zero block (scale replaced by 0.125)
    ws[1][2, 5] = -40.0  # an outlier
    shared = nvfp4.fused_global_scale(ws)
    for w in ws + [ws[0].bfloat16()]:
        for gs in (None, shared):
            _assert_same_q(awq.clipped_quantize_weight(w, gs, 1.0), nvfp4.quantize_weight(w, gs))
            _assert_same_q(awq.clipped_quantize_weight(w, gs, torch.ones(w.shape[0])), nvfp4.quantize_weight(w, gs))
            assert torch.equal(awq.clipped_fake_quantize(w, gs, 1.0), nvfp4.fake_quantize(w, gs))


def test_clipped_block_scales_use_shrunk_amax_and_saturate():
    g = _gen(7)
    w = torch.randn(4, 32, generator=g)
    gs = nvfp4.global_scale(w.abs().amax())
    q = awq.clipped_quantize_weight(w, gs, 0.75)
    expect = (gs * (nvfp4.block_amax(w) * 0.75 / 6)).clamp(max=448).to(torch.float8_e4m3fn)
    assert torch.equal(q["weight_scale"].float(), expect.float())
    assert torch.equal(q["weight_global_scale"], gs)
    deq = awq.clipped_fake_quantize(w, gs, 0.75).reshape(4, 2, 16)
    step = (q["weight_scale"].float() / gs).unsqueeze(-1)
    assert (deq.abs() <= 6 * step * (1 + 1e-6)).all()
    # per-row ratios: row i with ratio r_i is the tensor-ratio result on that row
    rows = torch.tensor([1.0, 0.9, 0.8, 0.75])
    per_row = awq.clipped_fake_quantize(w, gs, rows)
    for i, r in enumerate(rows.tolist()):
        assert torch.equal(per_row[i], awq.clipped_fake_quantize(w, gs, r)[i])
    with pytest.raises(ValueError):
        awq.clipped_quantize_weight(w, gs, 1.5)
    with pytest.raises(ValueError):
        awq.clipped_quantize_weight(w, gs, 0.0)


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_clip_search_never_worse_than_no_clip(granularity):
    cfg = awq.AWQConfig(clip_granularity=granularity)
    for seed in range(3):
        x, weights = _outlier_case(seed=10 + seed)
        # heavy-tailed weights make clipping worth something
        weights = [w * (1 + 5 * (torch.rand(w.shape, generator=_gen(seed)) > 0.98)) for w in weights]
        res = awq.search_scales(x, weights, cfg)
        clip = awq.search_clip(x, weights, res.scales, cfg)
        assert clip.error <= clip.error_unclipped
        assert clip.error_unclipped == awq.group_error(x, weights, res.scales)
        assert math.isclose(clip.error_unclipped, res.error, rel_tol=1e-9)
        assert clip.curve[1.0] == clip.error_unclipped and set(clip.curve) == set(cfg.clip_ratios)
        # the chosen ratios reproduce the reported error under the brief's formula
        assert math.isclose(clip.error, _direct_error(x, weights, res.scales, clip.ratios), rel_tol=1e-4)
        if granularity == "tensor":
            assert clip.error <= min(clip.curve.values())
            assert all(isinstance(r, float) and 0.75 <= r <= 1.0 for r in clip.ratios)
        else:
            assert all(r.shape == (w.shape[0],) for r, w in zip(clip.ratios, weights))
            assert clip.error <= min(clip.curve.values()) * (1 + 1e-12)


def test_clip_search_ties_keep_ratio_one():
    # weights already on the E2M1 grid with a block amax of exactly 6 * step: RTN is exact (error 0); ratio
    # 0.9999 gives the same e4m3 block scales (448 * 0.9999 rounds back to 448), i.e. an exact tie, and 1.0
    # must be kept; 0.9 and 0.95 lose.
    g = _gen(8)
    vals = torch.tensor(nvfp4.E2M1_MAGNITUDES)
    w = vals[torch.randint(0, 8, (8, 32), generator=g)]
    w[:, 0] = 6.0
    w[:, 16] = 6.0
    x = torch.randn(16, 32, generator=g)
    assert awq.group_error(x, [w]) == 0.0
    for gran in ("tensor", "row"):
        clip = awq.search_clip(x, [w], None, awq.AWQConfig(clip_granularity=gran, clip_ratios=(0.9999, 0.9, 1.0, 0.95)))
        assert clip.error == 0.0 and clip.curve[0.9999] == 0.0 and clip.curve[0.9] > 0.0
        r = clip.ratios[0]
        assert (r == 1.0) if isinstance(r, float) else torch.equal(r, torch.ones(8))


# ----------------------------------------------------------------------------------------------- config


def test_config_defaults():
    cfg = awq.AWQConfig()
    assert cfg.n_grid == 20 and cfg.clip_search is True
    assert cfg.alphas == [i / 20 for i in range(20)]
    assert cfg.clip_ratios[0] == 1.0 and cfg.clip_ratios[-1] == 0.75 and len(cfg.clip_ratios) == 11


@pytest.mark.parametrize("kwargs, match", [
    ({"n_grid": 0}, "n_grid"),
    ({"n_grid": -3}, "n_grid"),
    ({"n_grid": 2.5}, "n_grid"),
    ({"clip_ratios": (1.0, 0.0)}, r"\(0, 1\]"),
    ({"clip_ratios": (1.2,)}, r"\(0, 1\]"),
    ({"clip_ratios": (-0.5,)}, r"\(0, 1\]"),
    ({"clip_ratios": (float("nan"),)}, r"\(0, 1\]"),
    ({"clip_ratios": ()}, "empty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"clip_granularity": "block"}, "clip_granularity"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        awq.AWQConfig(**kwargs)


def test_coupled_search_weighs_the_producer_group():
    """up -> down: a down scale must not be chosen for down's error alone when it wrecks up's quantization."""
    g = torch.Generator().manual_seed(3)
    x_gu = torch.randn(512, 64, generator=g)
    gate, up = torch.randn(128, 64, generator=g), torch.randn(128, 64, generator=g)
    # wildly uneven channels: the down-only alpha divides some of up's rows by s so large that NVFP4 (one G
    # for gate and up) flushes them (measured in down's units, as the coupled search does)
    x_down = torch.randn(512, 128, generator=g) * torch.logspace(-10, 4, 128)
    down = torch.randn(64, 128, generator=g)
    cfg = awq.AWQConfig(n_grid=10)
    plain = awq.search_scales(x_down, [down], cfg)
    coupled = awq.search_scales_coupled(x_down, [down], awq.Producer(x_gu, [gate, up], 1), cfg)

    def producer_error(s):
        return _producer_error(x_gu, [gate, up], 1, s)

    assert coupled.error_rtn == pytest.approx(awq.group_error(x_down, [down]), rel=1e-6)
    # the coupled choice never makes the sum of relative errors worse than round-to-nearest (alpha = 0)
    assert min(coupled.errors) <= coupled.errors[0]
    # and it hurts the producer less than the down-only choice does
    assert producer_error(coupled.scales) < producer_error(plain.scales)
    assert plain.alpha > 0  # the down-only search did move (otherwise the comparison proves nothing)
    assert producer_error(plain.scales) > 1.2 * producer_error(torch.ones(128))  # and really hurt up


def _producer_error(px, weights, index, s, consumer_units=True):
    """Output SSE of a producer group whose member ``index`` has its rows divided by ``s`` (one shared G of the
    folded set): in the consumer's units ``px @ (Q(W/s) * s - W)^T``, or in the rescaled ones
    ``px @ (Q(W/s) - W/s)^T`` (the objective before the fix)."""
    prod = [w / s.unsqueeze(1) if i == index else w for i, w in enumerate(weights)]
    g = nvfp4.fused_global_scale(prod)
    sse = 0.0
    for i, (w, f) in enumerate(zip(weights, prod)):
        q = nvfp4.fake_quantize(f, g)
        delta = q * s.unsqueeze(1) - w if (i == index and consumer_units) else q - f
        sse += float((px @ delta.t()).double().square().sum())
    return sse


def test_coupled_search_measures_the_producer_error_in_the_consumers_units():
    """up -> down with outlier rows in up: folding divides up's rows by s, and down's columns multiply its
    outputs back by s, so up's error reaches down as Q(up/s)*s - up. Measured as Q(up/s) - up/s, the error of
    the outlier rows shrinks with s and the search picked too small an alpha (0.5 instead of 0.7 here)."""
    g = _gen(0)
    t, h, i = 1024, 128, 256
    px = torch.randn(t, h, generator=g)
    gate, up = torch.randn(i, h, generator=g) * 0.05, torch.randn(i, h, generator=g) * 0.05
    up[:8] *= 30
    act = torch.nn.functional.silu(px @ gate.t()) * (px @ up.t())  # down's input
    down = torch.randn(h, i, generator=g) * 0.05
    cfg = awq.AWQConfig(n_grid=10, max_tokens=None)
    res = awq.search_scales_coupled(act, [down], awq.Producer(px, [gate, up], 1), cfg)
    stats = act.abs().mean(0)
    ref = float((act @ down.t()).double().square().sum()) / (t * h)
    pref = (float((px @ gate.t()).double().square().sum()) + float((px @ up.t()).double().square().sum())) / (t * 2 * i)
    want, old = [], []
    for a in cfg.alphas:
        s = awq.scales_from_stats(stats, a)
        consumer = _direct_error(act, [down], s) / ref
        want.append(consumer + _producer_error(px, [gate, up], 1, s) / (t * 2 * i) / pref)
        old.append(consumer + _producer_error(px, [gate, up], 1, s, consumer_units=False) / (t * 2 * i) / pref)
    assert res.errors == pytest.approx(want, rel=1e-5)
    best = cfg.alphas[min(range(len(want)), key=want.__getitem__)]
    assert res.alpha == best == 0.7
    assert cfg.alphas[min(range(len(old)), key=old.__getitem__)] == 0.5  # the old objective's (wrong) choice


# ----------------------------------------------------------------------------------------------- row scales


def _folded_producer_case(seed: int = 2):
    """gate/up after down's fold divided up's rows by ``r`` (spanning 4 decades): returns (x, [gate, up],
    [gate, up / r], r)."""
    g = _gen(seed)
    x = torch.randn(256, 64, generator=g) * torch.logspace(0, 1.5, 64)[torch.randperm(64, generator=g)]
    gate, up = torch.randn(128, 64, generator=g) * 0.05, torch.randn(128, 64, generator=g) * 0.05
    r = torch.logspace(-2, 2, 128)[torch.randperm(128, generator=g)]
    return x, [gate, up], [gate, awq.fold_into_linear_output(up, r)], r


def _direct_unfolded_error(x, original, folded, s, row_scale, ratios=None):
    """Written out: ``((x/s) @ Q(W_f * s)^T) * r`` against ``x @ W^T`` (one shared G of the scaled set)."""
    scaled = [w * s for w in folded]
    g = nvfp4.fused_global_scale(scaled)
    ratios = ratios or [1.0] * len(folded)
    sse = 0.0
    for w0, ws, r, c in zip(original, scaled, row_scale, ratios):
        y = (x / s) @ awq.clipped_fake_quantize(ws, g, c).t()
        sse += float(((y if r is None else y * r) - x @ w0.t()).double().square().sum())
    return sse / (x.shape[0] * sum(w.shape[0] for w in original))


def test_row_scale_none_or_ones_is_the_plain_error_bit_for_bit():
    x, weights = _outlier_case(seed=4)
    cfg = awq.AWQConfig(n_grid=6)
    plain = awq.search_scales(x, weights, cfg)
    for rs in ([None] * 3, [torch.ones(w.shape[0]) for w in weights]):
        res = awq.search_scales(x, weights, cfg, row_scale=rs)
        assert res.errors == plain.errors and res.ref_power == plain.ref_power and res.alpha == plain.alpha
        assert awq.group_error(x, weights, plain.scales, row_scale=rs) == awq.group_error(x, weights, plain.scales)
        assert awq.output_power(x, weights, rs) == awq.output_power(x, weights)
        a, b = awq.search_clip(x, weights, plain.scales, cfg, rs), awq.search_clip(x, weights, plain.scales, cfg)
        assert a.curve == b.curve and a.ratios == b.ratios and a.error == b.error


def test_row_scale_measures_a_folded_group_in_the_unfolded_units():
    """gate/up searched after down's fold divided up's rows by r: with ``row_scale`` every candidate's error is
    the unfolded layer's output error, the output power is the unfolded one, and the choice is that error's
    minimizer; on the folded weights alone (rows weighted 1) the search picks alpha 0.2, 10 % worse here."""
    x, original, folded, r = _folded_producer_case()
    cfg = awq.AWQConfig(n_grid=10)
    res = awq.search_scales(x, folded, cfg, row_scale=[None, r])
    stats = awq.activation_stats(x)
    want = [_direct_unfolded_error(x, original, folded, awq.scales_from_stats(stats, a), [None, r])
            for a in cfg.alphas]
    assert res.errors == pytest.approx(want, rel=1e-4)
    assert res.alpha == cfg.alphas[min(range(len(want)), key=want.__getitem__)] == 0.6
    assert res.error_rtn == awq.group_error(x, folded, row_scale=[None, r])
    assert res.ref_power == pytest.approx(awq.output_power(x, original), rel=1e-5)
    assert awq.output_power(x, folded, [None, r]) == pytest.approx(awq.output_power(x, original), rel=1e-5)
    folded_units = awq.search_scales(x, folded, cfg)
    assert folded_units.alpha == 0.2  # the old objective's choice ...
    assert want[cfg.alphas.index(0.2)] > 1.09 * res.error  # ... is worse in the layer's units


@pytest.mark.parametrize("granularity", ["tensor", "row"])
def test_clip_search_with_row_scale(granularity):
    """Clip ratios chosen in the unfolded units; ratio 1.0 reproduces the unclipped error exactly, so
    clipping never makes the group worse in those units."""
    x, original, folded, r = _folded_producer_case()
    folded = [w * (1 + 5 * (torch.rand(w.shape, generator=_gen(1)) > 0.98)) for w in folded]  # worth clipping
    original = [folded[0], folded[1] * r.unsqueeze(1)]
    cfg = awq.AWQConfig(n_grid=10, clip_granularity=granularity)
    res = awq.search_scales(x, folded, cfg, row_scale=[None, r])
    clip = awq.search_clip(x, folded, res.scales, cfg, row_scale=[None, r])
    assert clip.error_unclipped == clip.curve[1.0] == awq.group_error(x, folded, res.scales, row_scale=[None, r])
    assert clip.error_unclipped == pytest.approx(res.error, rel=1e-9)
    assert clip.error <= clip.error_unclipped
    assert clip.error == pytest.approx(_direct_unfolded_error(x, original, folded, res.scales, [None, r],
                                                              clip.ratios), rel=1e-4)
    assert clip.error == pytest.approx(awq.group_error(x, folded, res.scales, clip.ratios, [None, r]), rel=1e-9)
    plain = awq.search_clip(x, folded, res.scales, cfg)  # rows weighted 1: the folded units
    if granularity == "row":  # a positive weight per row does not change each row's own argmin
        assert clip.error < 0.95 * clip.error_unclipped
        assert all(torch.equal(a, b) for a, b in zip(clip.ratios, plain.ratios))
    else:  # but it changes a whole tensor's: up keeps 1.0 here, where the folded units clip it to 0.975
        assert clip.ratios == [1.0, 1.0] and plain.ratios == [1.0, 0.975]
        assert awq.group_error(x, folded, res.scales, plain.ratios, [None, r]) > clip.error


def test_coupled_producer_term_is_the_producers_alpha_zero_error():
    """The producer term of the consumer's coupled search at its chosen scale is, bit for bit, the alpha = 0
    error the producer group's own search reports once that scale is folded (its rows divided, row_scale
    passed): the producer's search starts exactly where the consumer's left it."""
    g = _gen(3)
    x_gu = torch.randn(512, 64, generator=g)
    gate, up = torch.randn(128, 64, generator=g) * 0.05, torch.randn(128, 64, generator=g) * 0.05
    x_down = torch.randn(512, 128, generator=g) * torch.logspace(-1, 2, 128)
    down = torch.randn(64, 128, generator=g) * 0.05
    cfg = awq.AWQConfig(n_grid=10)
    producer = awq.Producer(x_gu, [gate, up], 1)
    res = awq.search_scales_coupled(x_down, [down], producer, cfg)
    assert res.alpha > 0 and res.producer_error is not None
    assert res.producer_error == awq.producer_error(producer, res.scales, cfg)
    after = awq.search_scales(x_gu, [gate, awq.fold_into_linear_output(up, res.scales)], cfg,
                              row_scale=[None, res.scales])
    assert after.errors[0] == after.error_rtn == res.producer_error
    assert after.error <= res.producer_error
    # the chosen total is the consumer's and producer's relative errors, and alpha = 0 is plain RTN of both
    pref = awq.output_power(x_gu, [gate, up])
    assert res.errors[cfg.alphas.index(res.alpha)] == pytest.approx(
        res.error / res.ref_power + res.producer_error / pref, rel=1e-12)
    assert res.errors[0] == pytest.approx(awq.group_error(x_down, [down]) / res.ref_power
                                          + awq.group_error(x_gu, [gate, up]) / pref, rel=1e-12)
    assert awq.producer_error(producer, None, cfg) == awq.group_error(x_gu, [gate, up])


def test_row_scale_is_checked():
    x, weights = _outlier_case()
    with pytest.raises(ValueError, match="3 weights"):
        awq.group_error(x, weights, row_scale=[None])
    with pytest.raises(ValueError, match=r"shape \[16\]"):
        awq.search_scales(x, weights, row_scale=[None, torch.ones(32), None])
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        r = torch.ones(16)
        r[3] = bad
        with pytest.raises(ValueError, match="finite and > 0"):
            awq.search_clip(x, weights, row_scale=[None, None, r])
