"""kernel.linear_lora: a decode step's LoRA term inside the small-M NVFP4 kernels (``-m gpu``; session 14). The
engine's use of it is tested in test_engine_gpu.py (GPU) and test_engine.py (CPU, the kernels replaced by their
torch definitions)."""

from __future__ import annotations

import pytest
import torch

from qerl_cli import fused, kernel, layout
from test_kernel import make_packed

pytestmark = pytest.mark.gpu


def _term(sizes, ranks, m, seed):
    """A fused group's batched LoRA term: ``hs [m, R]`` (fp32 holding bf16 values), ``bs [R, n]`` bf16
    block-diagonal (member i: its ``ranks[i]`` rank rows, 0 = no term), ``segs`` as in ``fused.lora_add``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n, r = sum(sizes), sum(ranks)
    hs = (torch.randn(m, r, device="cuda", generator=g) * 2).to(torch.bfloat16).float()
    bs = torch.zeros(r, n, device="cuda", dtype=torch.bfloat16)
    segs, row, col = [], 0, 0
    for size, rank in zip(sizes, ranks):
        bs[row: row + rank, col: col + size] = (torch.randn(rank, size, device="cuda", generator=g) * 0.5).to(
            torch.bfloat16)
        col += size
        segs += [col, row, row + rank]
        row += rank
    return hs, bs, tuple(segs)


def _fp32_slack(x, w, hs, bs):
    """What fp32 sums in another order may differ by: 2^-20 of the sums of |products| (``w``: the dequantized
    weight, fp32)."""
    return (x.float().abs() @ w.abs().t() + hs.float().abs() @ bs.float().abs()) * 2.0 ** -20


def _expect(x, w, hs, bs, bias):
    """The fp32 value of ``x W^T + hs @ bs (+ bias)`` and a bound on what rounding may move it: the kernel
    rounds base + term to bf16 once, then adds the bias and rounds again (at most half a bf16 unit, 2^-8
    relative, each), after fp32 sums in its own order."""
    base = x.float() @ w.t()
    term = hs.float() @ bs.float()
    value, scale = base + term, base.abs() + term.abs()
    if bias is not None:
        value, scale = value + bias.float(), scale + bias.float().abs()
    return value, scale * 2.0 ** -7 + _fp32_slack(x, w, hs, bs) + 1e-6


@pytest.fixture
def settings():
    """Restores the variant, split override, cluster setting and large-M threshold a test changes; the tests run
    without autograd, as the engine's decode steps do (``linear_lora`` declines under grad mode)."""
    assert kernel.available(), f"CUDA extension failed to build: {kernel.build_error()}"
    ext = kernel._load()
    before = (kernel.variant(), bool(ext.get_cluster()), kernel.large_m_threshold())
    with torch.no_grad():
        yield ext
    ext.set_split_override(0)
    kernel.set_variant(before[0])
    kernel.set_cluster(before[1])
    kernel.set_large_m_threshold(before[2])


@pytest.mark.parametrize("sizes,ranks,k", [
    ((256, 64, 64), (16, 16, 16), 256),     # a small q/k/v group
    ((3584, 512, 512), (32, 32, 32), 3584),  # Qwen2.5-7B's q/k/v at rank 32
    ((3584, 512, 512), (32, 0, 32), 3584),   # q and v only: k's columns have no rank rows
    ((512,), (64,), 1024),                  # one linear (o), rank 64
    ((1000,), (16,), 1008),                 # rows past n in the last 16-row block, K past a 64-tile
    ((18944, 18944), (32, 32), 3584),        # Qwen2.5-7B's gate/up (auto: v2w10 to M = 16 on 132 SMs, v2w8)
    ((3584,), (32,), 18944),                # Qwen2.5-7B's down
])
@pytest.mark.parametrize("variant", ["default", "alt", "v2", "v2w8", "v2w10"])
def test_linear_lora_against_fp32(sizes, ranks, k, variant, settings):
    """The output of ``linear_lora`` (poisoned before each call) is ``x W^T + hs @ bs (+ bias)`` within its two
    roundings, at M = 1 ... 64 (hs fp32 or bf16; above M = 32 only the weights the mma kernels take), for every
    small-M kernel: the two v1 configurations unsplit and with forced K
    splits reduced in a cluster and in the workspace (cluster and workspace give the same bits at the same split:
    the term is part of the last split's partial in both) and with the automatic split with clusters on and off
    (the default at 8 < M <= 16 is a cluster split), the stream-K ones with row groups cut between CTAs (the large
    shapes); a second call gives the same bits."""
    ext = settings
    kernel.set_variant(variant)
    n = sum(sizes)
    qw, gs = make_packed(n, k, device="cuda", seed=n + k)
    w = layout.dequantize(qw, gs, n, k, torch.float32)
    b = (torch.randn(n, device="cuda") * 2).to(torch.bfloat16)
    kt = (k + 63) // 64
    clusters = torch.cuda.get_device_capability()[0] >= 9
    splits = (0,) if variant.startswith("v2") else sorted({0, 2, min(3, kt), min(8, kt)})
    for m in (1, 3, 8, 9, 16, 17, 32, 40, 64):
        hs, bs, segs = _term(sizes, ranks, m, seed=m)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        if m in (9, 17, 40):  # hs as bf16 (a matmul's shrink, the engine above 16 rows; at M <= 16 the host
            hs = hs.to(torch.bfloat16)  # converts it to the fp32 those instances read)
        for split in splits:
            ext.set_split_override(split)
            outs = {}
            for cl in ((True, False) if clusters else (False,)):
                kernel.set_cluster(cl)
                if not kernel.takes_lora(m, n, k):  # the dequantize path: small weights above M = 32, or at 32
                    # without clusters (choose_path)
                    assert m >= 32 and kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs) is None, (m, cl)
                    continue
                for bias in (None, b):
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    y = kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs, bias=bias, out=out)
                    assert y is out, (m, split, cl)
                    value, bound = _expect(x, w, hs, bs, bias)
                    err = (out.float() - value).abs()
                    assert not torch.isnan(out).any(), (m, split, cl)
                    assert bool((err <= bound).all()), (m, split, cl, bias is None, float((err - bound).max()))
                    outs[cl, bias is None] = out
            if len(outs) == 4 and split:  # (the automatic split differs with and without clusters)
                for nb in (True, False):
                    assert torch.equal(outs[True, nb], outs[False, nb]), (m, split, nb)
            if (False, True) in outs:
                again = kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs)  # (clusters off, as the last call above)
                assert torch.equal(again, outs[False, True])


def test_linear_lora_near_the_separate_expand(settings):
    """Against what the engine ran before (``linear`` with the bias, then ``fused.lora_expand``, which rounds
    base + bias first): with and without a bias the two differ by at most their roundings (half a bf16 unit of
    the base, of base + bias, of base + term and of each result)."""
    kernel.set_variant("auto")
    sizes, ranks, k = (3584, 512, 512), (32, 32, 32), 3584
    n = sum(sizes)
    qw, gs = make_packed(n, k, device="cuda", seed=5)
    w = layout.dequantize(qw, gs, n, k, torch.float32)
    hs, bs, segs = _term(sizes, ranks, 8, seed=9)
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    b = (torch.randn(n, device="cuda") * 4).to(torch.bfloat16)
    for bias in (None, b):
        y = kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs, bias=bias)
        based = kernel.linear(x, qw, gs, n, k, bias=bias)
        chain = fused.lora_expand(based, hs, bs, segs)
        assert y is not None and chain is not None
        a, c = y.float(), chain.float()
        base = kernel.linear(x, qw, gs, n, k).float()
        # half a unit (2^-8 relative) per rounding, doubled: |base + term| is at most |base| + |based| + |c| there
        bound = (base.abs() + based.float().abs() + a.abs() + c.abs()) * 2.0 ** -7 + _fp32_slack(x, w, hs, bs) + 1e-6
        assert bool(((a - c).abs() <= bound).all()), bias is None


def test_linear_lora_declines_without_launching(settings):
    """Where no small-M kernel runs the product or the term is outside what it takes, ``linear_lora`` returns
    None and leaves the output untouched: the dequantize path (the large-M threshold lowered under M), more than 64
    rows, rank rows that are not whole 16-row steps, a member boundary inside a 16-row block; ``takes_lora``
    agrees on the first two, and says yes for auto's stream-K choice (the 7B gate/up at M = 8: v2w8, or v2w10 since
    session 21; the term runs in the stream-K kernels in test_linear_lora_against_fp32). An hs at an odd element offset (fp32 at M = 8, bf16
    at M = 17: the host copies it to an aligned tensor) gives the aligned one's bits."""
    ext = settings
    n, k = 384, 256
    qw, gs = make_packed(n, k, device="cuda", seed=1)
    x8 = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    hs, bs, segs = _term((256, 64, 64), (16, 16, 16), 8, seed=2)

    def declined(x, hs, bs, segs):
        out = torch.full((x.shape[0], n), float("nan"), device="cuda", dtype=torch.bfloat16)
        r = kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs, out=out)
        torch.cuda.synchronize()
        return r is None and bool(torch.isnan(out).all())

    kernel.set_variant("auto")
    assert kernel.takes_lora(8, n, k) and not declined(x8, hs, bs, segs)
    stream_k = (kernel.VARIANTS["v2w8"], kernel.VARIANTS["v2w10"])  # (v2w10 where its 160-row groups align)
    assert ext.auto_variant(8, 37888, 3584) in stream_k and kernel.takes_lora(8, 37888, 3584)
    kernel.set_large_m_threshold(4)
    assert not kernel.takes_lora(8, n, k) and declined(x8, hs, bs, segs)
    kernel.set_large_m_threshold(64)
    x17 = torch.randn(17, k, device="cuda", dtype=torch.bfloat16)
    hs17, _, _ = _term((256, 64, 64), (16, 16, 16), 17, seed=3)
    assert kernel.takes_lora(17, n, k) and not declined(x17, hs17.to(torch.bfloat16), bs, segs)  # (session 15)
    # 65 rows where the mma kernel would run them (threshold and cluster limit raised): linear_lora's own limit
    kernel.set_large_m_threshold(128)
    cluster_max_m = int(ext.get_cluster_max_m())
    ext.set_cluster_max_m(128)
    try:
        x65 = torch.randn(65, k, device="cuda", dtype=torch.bfloat16)
        hs65, _, _ = _term((256, 64, 64), (16, 16, 16), 65, seed=3)
        assert ext.choose_path(65, n, k) == 0 and not kernel.takes_lora(65, n, k) and declined(x65, hs65, bs, segs)
    finally:
        ext.set_cluster_max_m(cluster_max_m)
        kernel.set_large_m_threshold(64)
    w = layout.dequantize(qw, gs, n, k, torch.float32)
    for x, h, dt in ((x8, hs, torch.float32), (x17, hs17, torch.bfloat16)):  # hs at an odd element offset
        h = h.to(dt)
        odd = torch.empty(h.numel() + 1, device="cuda", dtype=dt)[1:].view(h.shape).copy_(h)
        a, b_ = kernel.linear_lora(x, qw, gs, n, k, h, bs, segs), kernel.linear_lora(x, qw, gs, n, k, odd, bs, segs)
        value, bound = _expect(x, w, h, bs, None)
        assert torch.equal(a, b_) and bool(((a.float() - value).abs() <= bound).all()), dt
    hs6, bs6, segs6 = _term((256, 64, 64), (6, 6, 6), 8, seed=4)
    assert declined(x8, hs6, bs6, segs6)
    hs_b, bs_b, _ = _term((248, 72, 64), (16, 16, 16), 8, seed=5)
    assert declined(x8, hs_b, bs_b, (248, 0, 16, 320, 16, 32, 384, 32, 48))


@pytest.mark.gpu
def test_linear_lora_cluster_sums_bit_identical(settings):
    """With a LoRA term the aligned grid's cluster sums (set_v2_cluster) give the workspace's bits too: the term
    rides in the partial of the split that ends the row group's K range either way (7B down, rank 32, auto)."""
    ext = settings
    n, k = 3584, 18944
    qw, gs = make_packed(n, k, device="cuda", seed=7)
    kernel.set_variant("auto")
    cluster_before = bool(ext.get_v2_cluster())
    try:
        for m in (1, 8, 16):
            hs, bs, segs = _term((n,), (32,), m, seed=m + 40)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs, used = [], []
            for on in (False, True):
                kernel.set_v2_cluster(on)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                assert kernel.linear_lora(x, qw, gs, n, k, hs, bs, segs, out=out) is not None
                used.append(int(ext.last_v2_cluster()))
                outs.append(out)
            torch.cuda.synchronize()
            assert not torch.isnan(outs[0]).any() and torch.equal(outs[0], outs[1]), (m, used)
            props = torch.cuda.get_device_properties(0)  # (H100 / H200 SXM: the 28 clusters of 8 measured to fit)
            if torch.cuda.get_device_capability() == (9, 0) and props.multi_processor_count == 132:
                assert used[0] == 0 and used[1] == 8, (m, used)
    finally:
        kernel.set_v2_cluster(cluster_before)
