"""qerl_cli.kernel: the torch fallback and op registration (everywhere), the CUDA kernel (``-m gpu``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from qerl_cli import kernel, layout, nvfp4

# ------------------------------------------------------------------------------------------- helpers


def make_packed(n: int, k: int, device="cpu", seed: int = 0, kind: str = "randn"):
    """A packed NVFP4 weight of shape [n, k]: (qweight, global_scale).

    kind: "randn" quantizes a Gaussian weight with the real quantizer; "codes" draws every code 0..15 and
    e4m3 block scales over the whole positive range (subnormals included) uniformly; "tiny" quantizes a
    weight whose blocks are ~5e-6 of one outlier, so most block scales are e4m3 subnormals."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "codes":
        codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        sbytes = torch.randint(1, 0x7F, (n, k // 16), generator=gen, dtype=torch.uint8)  # 0x7f is NaN
        scales = sbytes.view(torch.float8_e4m3fn)
        gs = torch.tensor([float(torch.rand(1, generator=gen)) * 1000 + 10.0])
        return layout.pack(codes.to(device), scales.to(device)), gs.to(device)
    w = torch.randn(n, k, generator=gen)
    if kind == "tiny":
        w = w * 5e-6
        w[0, 0] = 1.0
    q = nvfp4.quantize_weight(w.to(device))
    codes = nvfp4.unpack_nibbles(q["weight_packed"])
    return layout.pack(codes, q["weight_scale"]), q["weight_global_scale"]


def ref_fp32(x, qweight, gs, n, k):
    w = layout.dequantize(qweight, gs, n, k, torch.float32)
    return x.float() @ w.t()


def rel_err(out, ref) -> float:
    out, ref = out.detach().float(), ref.detach().float()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------ CPU: everywhere


@pytest.mark.parametrize("n,k,m", [(32, 64, 3), (200, 80, 5), (17, 48, 1), (576, 192, 9)])
def test_cpu_fallback_equals_reference(n, k, m):
    qw, gs = make_packed(n, k, seed=n + k)
    x = torch.randn(2, m, k, dtype=torch.bfloat16)
    out = kernel.linear(x, qw, gs, n, k)
    assert kernel.last_backend() == kernel.BACKEND_REFERENCE
    assert out.shape == (2, m, n) and out.dtype == torch.bfloat16
    ref = layout.reference_matmul(x.reshape(-1, k), qw, gs, n, k).reshape(2, m, n)
    assert torch.equal(out, ref)

    g = torch.randn(m, n)
    gt = kernel.linear_t(g, qw, gs, n, k)
    assert gt.shape == (m, k) and gt.dtype == torch.float32
    assert torch.equal(gt, g @ layout.dequantize(qw, gs, n, k, torch.float32))

    for dt in (torch.bfloat16, torch.float32):
        assert torch.equal(kernel.dequantize(qw, gs, n, k, dt), layout.dequantize(qw, gs, n, k, dt))


def test_cpu_out_variant_and_autograd():
    n, k = 48, 128
    qw, gs = make_packed(n, k, seed=3)
    x = torch.randn(4, k)
    out = torch.full((4, n), float("nan"))
    assert kernel.linear(x, qw, gs, n, k, out=out) is out
    assert torch.equal(out, layout.reference_matmul(x, qw, gs, n, k))

    xr = x.clone().requires_grad_(True)
    y = kernel.linear(xr, qw, gs, n, k)
    gy = torch.randn_like(y)
    y.backward(gy)
    w = layout.dequantize(qw, gs, n, k, torch.float32)
    torch.testing.assert_close(xr.grad, gy @ w)


def test_cpu_bias_equals_add_after_rounding():
    """bias: added after the product is rounded to x's dtype (what ``linear(x) + bias`` does), both forms."""
    n, k = 80, 64
    qw, gs = make_packed(n, k, seed=11)
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(5, k, dtype=dt)
        b = torch.randn(n, dtype=dt) * 3
        expect = kernel.linear(x, qw, gs, n, k) + b
        assert torch.equal(kernel.linear(x, qw, gs, n, k, bias=b), expect)
        out = torch.full((5, n), float("nan"), dtype=dt)
        assert torch.equal(kernel.linear(x, qw, gs, n, k, out=out, bias=b), expect)
    # a bias of another dtype is converted first; the gradient flows to x only
    xr = torch.randn(3, k, requires_grad=True)
    y = kernel.linear(xr, qw, gs, n, k, bias=torch.ones(n, dtype=torch.float64))
    y.sum().backward()
    torch.testing.assert_close(xr.grad, torch.ones(3, n) @ layout.dequantize(qw, gs, n, k, torch.float32))
    with pytest.raises(ValueError, match="bias must be"):
        torch.ops.qerl.linear(torch.randn(2, k), qw, gs, n, k, torch.ones(n + 1))
    torch.library.opcheck(torch.ops.qerl.linear.default, (xr.detach().requires_grad_(True), qw, gs, n, k,
                                                          torch.randn(n)))


def test_fake_and_meta_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    n, k = 100, 96
    qw, gs = make_packed(n, k)
    with FakeTensorMode() as mode:
        fx = mode.from_tensor(torch.randn(3, 7, k, dtype=torch.bfloat16))
        fq, fg = mode.from_tensor(qw), mode.from_tensor(gs)
        y = torch.ops.qerl.linear(fx, fq, fg, n, k)
        assert tuple(y.shape) == (3, 7, n) and y.dtype == torch.bfloat16
        fgrad = mode.from_tensor(torch.randn(5, n))
        assert tuple(torch.ops.qerl.linear_t(fgrad, fq, fg, n, k).shape) == (5, k)
        d = torch.ops.qerl.dequantize(fq, fg, n, k, torch.float16)
        assert tuple(d.shape) == (n, k) and d.dtype == torch.float16
    # meta tensors go through the same fake implementations
    mq = torch.empty(qw.shape, dtype=torch.uint8, device="meta")
    mg = torch.empty(1, dtype=torch.float32, device="meta")
    y = kernel.linear(torch.empty(2, k, dtype=torch.bfloat16, device="meta"), mq, mg, n, k)
    assert y.device.type == "meta" and tuple(y.shape) == (2, n)
    with pytest.raises(ValueError):
        kernel.linear(torch.empty(2, k + 16, device="meta"), mq, mg, n, k)


def test_compile_traces_the_op():
    n, k = 64, 64
    qw, gs = make_packed(n, k, seed=5)
    x = torch.randn(3, k)

    def f(a):
        return kernel.linear(a, qw, gs, n, k) * 2

    out = torch.compile(f, backend="eager", fullgraph=True)(x)  # (a graph break or a broken fake impl fails)
    assert torch.equal(out, f(x))


def test_errors_on_bad_shapes():
    n, k = 64, 128
    qw, gs = make_packed(n, k)
    x = torch.randn(2, k)
    with pytest.raises(ValueError, match="last dimension"):
        kernel.linear(torch.randn(2, k - 16), qw, gs, n, k)
    with pytest.raises(ValueError, match="does not hold"):
        kernel.linear(x, qw, gs, n + 16, k)
    with pytest.raises(ValueError, match="multiple of 16"):
        kernel.linear(x, qw, gs, n, k + 8)
    with pytest.raises(ValueError, match="uint8"):
        kernel.linear(x, qw.float(), gs, n, k)
    with pytest.raises(ValueError, match="global_scale"):
        kernel.linear(x, qw, gs.double(), n, k)
    with pytest.raises(ValueError, match="global_scale"):
        kernel.linear(x, qw, torch.ones(2), n, k)
    with pytest.raises(ValueError, match="floating point"):
        kernel.linear(x.to(torch.int32), qw, gs, n, k)
    with pytest.raises(ValueError, match="last dimension"):
        kernel.linear_t(torch.randn(2, n + 1), qw, gs, n, k)
    with pytest.raises(ValueError, match="out must"):
        kernel.linear(x, qw, gs, n, k, out=torch.empty(2, n + 1))


def test_opcheck_cpu():
    n, k = 40, 64
    qw, gs = make_packed(n, k, seed=7)
    x = torch.randn(3, k, requires_grad=True)
    torch.library.opcheck(torch.ops.qerl.linear.default, (x, qw, gs, n, k))
    torch.library.opcheck(torch.ops.qerl.linear_t.default, (torch.randn(3, n), qw, gs, n, k))
    torch.library.opcheck(torch.ops.qerl.dequantize.default, (qw, gs, n, k, torch.bfloat16))
    torch.library.opcheck(torch.ops.qerl.linear_out.default, (x.detach(), qw, gs, n, k, torch.empty(3, n)))
    q2, g2 = make_packed(17, 48, seed=8)
    torch.library.opcheck(torch.ops.qerl.dequantize_many.default, ([qw, q2], [gs, g2], [n, 17], [k, 48]))


def test_dequantize_many_cpu():
    """Views of one flat bf16 buffer, each the dequantized weight (the reference on CPU), in the given order;
    bad argument lists are one ValueError."""
    shapes = [(40, 64), (17, 48), (16, 16), (33, 80)]
    packed = [make_packed(n, k, seed=20 + i, kind="codes") for i, (n, k) in enumerate(shapes)]
    ws = kernel.dequantize_many([(q, g, n, k) for (q, g), (n, k) in zip(packed, shapes)])
    assert [tuple(w.shape) for w in ws] == shapes
    assert len({w.untyped_storage().data_ptr() for w in ws}) == 1  # one buffer
    for w, (q, g), (n, k) in zip(ws, packed, shapes):
        assert w.dtype == torch.bfloat16 and torch.equal(w, layout.dequantize(q, g, n, k, torch.bfloat16))
    assert kernel.dequantize_many([]) == []
    (q, g), (n, k) = packed[0], shapes[0]
    with pytest.raises(ValueError, match="as many scales"):
        torch.ops.qerl.dequantize_many([q, q], [g], [n, n], [k, k])
    with pytest.raises(ValueError, match="does not hold|multiple of 16"):
        kernel.dequantize_many([(q, g, n, k + 16)])


@pytest.mark.parametrize("cap", [264, 216, 660, 296])
def test_aligned_grid_partition_cpu(cap):
    """The arithmetic the stream-K kernel's aligned grids rest on (the host's aligned_splits, mirrored by
    _aligned_splits; the kernel's sk_begin(b) = b * W / P): with P = RG * s blocks over W = RG * KT units, every
    block's range is non-empty and inside one row group, row group r goes to blocks r * s ... r * s + s - 1 in K
    order (a cluster's rank order is the workspace's slot order), and the grid is resident and fills 3/4 of it."""
    grids = 0
    for rg in (1, 5, 23, 28, 36, 40, 56, 237, 296):
        for kt in (4, 9, 56, 63, 80, 296, 432):
            s = _aligned_splits(rg, kt, cap)
            if s == 0:
                continue
            grids += 1
            p, w = rg * s, rg * kt
            assert 1 <= s <= kt // 4 and p <= cap and 4 * p >= 3 * cap, (rg, kt, cap, s)
            for b in range(p):
                u0, u1 = b * w // p, (b + 1) * w // p
                assert u1 > u0 and u0 // kt == (u1 - 1) // kt == b // s, (rg, kt, s, b)
                assert u0 % kt == (b % s) * kt // s, (rg, kt, s, b)  # split j starts at j * KT / s of its group
    assert grids >= 10, grids
    assert _aligned_splits(28, 296, 264) == 8 and _aligned_splits(296, 56, 264) == 0  # (7B down; 7B gate/up, 8 warps)


def test_variant_selection_cpu():
    before = kernel.variant()
    try:
        kernel.set_variant("v2")
        assert kernel.variant() == "v2"
        n, k = 48, 128  # the reference ignores the variant: results unchanged
        qw, gs = make_packed(n, k, seed=8)
        x = torch.randn(3, k, dtype=torch.bfloat16)
        assert torch.equal(kernel.linear(x, qw, gs, n, k), layout.reference_matmul(x, qw, gs, n, k))
        with pytest.raises(ValueError, match="unknown kernel variant"):
            kernel.set_variant("v3")
        assert kernel.variant() == "v2"
    finally:
        kernel.set_variant(before)
    assert kernel.variant() == before


def test_v2_prefetch_distance_checked():
    """The L2 prefetch distance is a number of K tiles in 0 ... 255 (the kernel's flags hold 8 bits of it): anything
    else is refused before it reaches the extension."""
    for bad in (-1, 256, 10**6):
        with pytest.raises(ValueError, match="0 ... 255 tiles"):
            kernel.set_v2_prefetch(bad)
    kernel.set_v2_prefetch(0)


def test_available_reports_reason_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    assert kernel.available() is False
    assert kernel.build_error()
    assert kernel.tc_max_m() == 0 and "tc_max_m" not in kernel.settings()
    with pytest.raises(RuntimeError, match="CUDA extension unavailable"):
        kernel.set_tc_max_m(512)


def test_linear_lora_declines_on_cpu():
    """The LoRA term inside the kernel is a CUDA-only fast path: on CPU ``takes_lora`` says no and
    ``linear_lora`` returns None, computing nothing (the engine then adds the term itself)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    qw, gs = make_packed(32, 64)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    hs, bs = torch.randn(4, 16).to(torch.bfloat16).float(), torch.randn(16, 32).to(torch.bfloat16)
    assert not kernel.takes_lora(4, 32, 64)
    with torch.no_grad():
        assert kernel.linear_lora(x, qw, gs, 32, 64, hs, bs) is None


# ------------------------------------------------------------------------------------------ GPU only

SMOL = [(576, 576), (1536, 576), (576, 1536), (192, 576), (960, 576)]
QWEN7B = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
ODD = [(200, 80), (17, 48), (1000, 1008)]
SMALL_M = [1, 2, 3, 5, 8, 9, 13, 16, 17, 31, 32, 33, 47, 64]
MID_M = [65, 100, 128, 129, 257, 1000]


def _need_kernel():
    assert kernel.available(), f"CUDA extension failed to build: {kernel.build_error()}"


def _check_linear(n, k, ms, kind="randn", seed=0, paths=(None,), tol=1e-2):
    qw, gs = make_packed(n, k, device="cuda", seed=seed, kind=kind)
    ext = kernel._load()
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = ref_fp32(x, qw, gs, n, k)
        for path in paths:
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)  # poisoned
            if path is None:
                kernel.linear(x, qw, gs, n, k, out=out)
                expect = {0: kernel.BACKEND_KERNEL, 2: kernel.BACKEND_TILED}.get(int(ext.choose_path(m, n, k)),
                                                                                   kernel.BACKEND_DEQUANT)
                assert kernel.last_backend() == expect
            else:
                ext.linear_out(x, qw, gs, n, k, out, path)
            torch.cuda.synchronize()
            assert not torch.isnan(out).any(), f"NaN/unwritten output at n={n} k={k} m={m} path={path}"
            e = rel_err(out, ref)
            assert e <= tol, f"rel err {e:.2e} at n={n} k={k} m={m} path={path}"


@pytest.fixture(params=["auto", "default", "alt", "v2", "v2w8", "v2w10"])
def small_m_variant(request):
    """Run a small-M test once per kernel variant; restores the previous variant."""
    _need_kernel()
    before = kernel.variant()
    kernel.set_variant(request.param)
    assert int(kernel._load().get_variant()) == kernel.VARIANTS[request.param]
    yield request.param
    kernel.set_variant(before)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", SMOL + ODD + QWEN7B)
def test_gpu_linear_small_m(n, k, small_m_variant):
    _check_linear(n, k, SMALL_M, seed=n * 7 + k, paths=(None, 0))  # auto, and the mma kernel at every M


ROW_ORDER_CHILD = """
import sys, torch
from qerl_cli import kernel, layout
assert kernel.available(), kernel.build_error()
ext = kernel._load()
for variant in ("auto", "default"):
    kernel.set_variant(variant)
    for n, k in ((576, 576), (4608, 3584)):
        g = torch.Generator().manual_seed(n + k)
        codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        scales = torch.randint(0x20, 0x40, (n, k // 16), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
        qw, gs = layout.pack(codes.cuda(), scales.cuda()), torch.tensor([100.0], device="cuda")
        w = layout.dequantize(qw, gs, n, k, torch.float32)
        for m in (16, 13, 16, 32, 20, 32, 64, 40, 64, 9, 16):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ w.t()
            for path in (-1, 0):
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                ext.linear_out(x, qw, gs, n, k, out, path)
                torch.cuda.synchronize()
                err = float((out.float() - ref).norm() / ref.norm())
                print(f"{variant}\t{n}x{k}\t{m}\t{path}\t{err:.3e}", flush=True)
                assert err <= 1e-2, (variant, n, k, m, path, err)
print("done", flush=True)
"""


@pytest.mark.gpu
def test_gpu_row_counts_shrinking_and_growing():
    """A kernel instance's shared memory grows with the rows it stages, above 48 KB for some (M = 9-16 on the
    default configuration, 17-64 on the v1 ones): a larger M after a smaller one must still launch. Session 15
    found M = 16 after M = 13 failing with "invalid argument" once another test file had run M = 16 first (the
    instance's shared-memory limit had been lowered to M = 13's size). A fresh child process, so that no earlier
    launch in the test run decides the order."""
    import os
    import subprocess
    import sys

    _need_kernel()
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", ROW_ORDER_CHILD], capture_output=True, text=True, env=env,
                         timeout=600)
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and lines[-1:] == ["done"], f"after {lines[-1:]}: {res.stderr[-1500:]}"
    assert len(lines) == 2 * 2 * 11 * 2 + 1


@pytest.mark.gpu
def test_gpu_auto_variant_rules():
    """auto's per-shape choice, as measured on the H200 (sessions 9 and 12's rules in ``auto_variant``) and refined
    on the device by the H100 measurements of sessions 21 and 22 (``auto_choice``), for the Qwen2.5 7B and 32B
    decode shapes."""
    _need_kernel()
    ext = kernel._load()
    v = kernel.VARIANTS
    qkv7, o7, gu7, dn7 = (4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)
    qkv32, o32, gu32, dn32 = (7168, 5120), (5120, 5120), (55296, 5120), (5120, 27648)
    # the device refinement (auto_choice) on 2 CTAs per SM (both stream-K instances' occupancy): the 7B gate/up's
    # 296 groups of 128 rows outnumber 264 slots on 132 SMs (H100, H200), v2w10's 237 groups of 160 align (32B
    # gate/up: 346 of them do not either); the 7B q/k/v and o take v2w8 at M <= 8 where it aligns, else v1
    cap = 2 * torch.cuda.get_device_properties(0).multi_processor_count
    gu7_small = "v2w10" if _aligned_splits(296, 56, cap) == 0 and _aligned_splits(237, 56, cap) > 0 else "v2w8"
    qkv7_small = "v2w8" if _aligned_splits(36, 56, cap) > 0 else "default"
    o7_small = "v2w8" if _aligned_splits(28, 56, cap) > 0 else "default"
    # session 22: v2w8 also where its aligned grid forms at M <= 8 (32B q/k/v), and at 8 < M <= 16 where that
    # grid's split sums run in clusters (asked of the device: a forced v2w8 launch at each M)
    qkv32_small = "v2w8" if _aligned_splits(56, 80, cap) > 0 else "v2"

    def mid(m: int) -> dict:  # 8 < m <= 16
        cl = {s: _w8_clusters_at(m, *s) for s in (qkv7, o7, qkv32, o32)}
        return {qkv7: "v2w8" if cl[qkv7] else "alt", o7: "v2w8" if cl[o7] else "alt", gu7: gu7_small, dn7: "v2w8",
                qkv32: "v2w8" if cl[qkv32] else "default", o32: "v2w8" if cl[o32] else "alt", gu32: "v2w8",
                dn32: "v2w8"}

    expect = {  # M range -> shape -> variant
        (1, 8): {qkv7: qkv7_small, o7: o7_small, gu7: gu7_small, dn7: "v2w8", qkv32: qkv32_small, o32: "v2w8",
                 gu32: "v2w8", dn32: "v2w8"},
        (9,): mid(9),
        (16,): mid(16),
        (17, 32, 33, 64): {qkv7: "default", o7: "default", gu7: "v2w8", dn7: "v2", qkv32: "default",
                           o32: "default", gu32: "v2w8", dn32: "v2w8"},
    }
    aligned_before, cluster_before = bool(ext.get_v2_aligned()), bool(ext.get_v2_cluster())
    try:
        kernel.set_v2_aligned(True)
        kernel.set_v2_cluster(True)
        for ms, table in expect.items():
            for m in ms:
                for (n, k), name in table.items():
                    assert int(ext.auto_variant(m, n, k)) == v[name], (m, n, k, name)
        # without row-group-aligned grids, the 7B q/k/v and o weights keep the v1 kernel at M <= 8
        kernel.set_v2_aligned(False)
        assert [int(ext.auto_variant(8, n, k)) for n, k in (qkv7, o7, gu7, dn7)] == [v["default"], v["default"],
                                                                                   v["v2w8"], v["v2w8"]]
    finally:
        kernel.set_v2_cluster(cluster_before)
        kernel.set_v2_aligned(aligned_before)


def _w8_clusters_at(m: int, n: int, k: int) -> bool:
    """Whether a v2w8 launch of ``m`` rows of an ``n x k`` weight runs its split sums in clusters on this device
    (aligned grids and cluster sums on)."""
    ext = kernel._load()
    before, aligned_before, cluster_before = kernel.variant(), bool(ext.get_v2_aligned()), bool(ext.get_v2_cluster())
    try:
        kernel.set_variant("v2w8")
        kernel.set_v2_aligned(True)
        kernel.set_v2_cluster(True)
        qw, gs = make_packed(n, k, device="cuda", seed=1)
        kernel.linear(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), qw, gs, n, k)
        torch.cuda.synchronize()
        return int(ext.last_v2_cluster()) > 0
    finally:
        kernel.set_v2_cluster(cluster_before)
        kernel.set_v2_aligned(aligned_before)
        kernel.set_variant(before)


def _replay_equals_eager(call, out: torch.Tensor) -> bool:
    """``call`` (which writes ``out``; run eagerly just before) captured in a CUDA graph and replayed onto a
    poisoned ``out`` gives the eager bits."""
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    first = out.clone()
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    return torch.equal(out, first)


def _aligned_splits(rg: int, kt: int, cap: int) -> int:
    """The host's aligned_splits (csrc/nvfp4_kernel.cu): splits per row group of the stream-K kernel's aligned
    grid for rg row groups of kt K tiles on cap resident CTA slots, 0 for none."""
    if rg < 1 or rg > cap:
        return 0
    smax = min(cap // rg, kt // 4)
    s = next((c for c in range(smax, 0, -1) if kt % c == 0), 0)
    if rg * s * 4 < cap * 3:
        s = smax
    return s if s >= 1 and rg * s * 4 >= cap * 3 else 0


def _clusters_expected() -> bool:
    """Whether the 7B down and o weights' aligned grids (28 row groups x 8 splits) run as clusters here: sm_90
    with H100 / H200 SXM's 132 SMs, where they measured to fit (elsewhere the host may fall back)."""
    return torch.cuda.get_device_capability() == (9, 0) and torch.cuda.get_device_properties(0).multi_processor_count == 132


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3584, 18944), (3584, 3584), (5120, 27648)])
def test_gpu_v2_cluster_sums_bit_identical(n, k):
    """An aligned grid's split-K sums through thread-block clusters (set_v2_cluster) add the same partials in the
    same order as the workspace and ticket: bit-identical outputs at every M up to 16 (poisoned), in a CUDA graph
    replay too; the 7B down and o weights do run as clusters (of their 8 splits) on an H100 / H200."""
    _need_kernel()
    ext = kernel._load()
    before, cluster_before = kernel.variant(), bool(ext.get_v2_cluster())
    qw, gs = make_packed(n, k, device="cuda", seed=2 * n + k)
    try:
        for v in ("v2w8",):  # (the cluster instances are the 8-warp ones)
            kernel.set_variant(v)
            for m in (1, 3, 8, 9, 16):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                outs, used = [], []
                for on in (False, True):
                    kernel.set_v2_cluster(on)
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    kernel.linear(x, qw, gs, n, k, out=out)
                    used.append(int(ext.last_v2_cluster()))
                    outs.append(out)
                torch.cuda.synchronize()
                assert used[0] == 0 and not torch.isnan(outs[0]).any(), (v, m)
                assert rel_err(outs[0], ref_fp32(x, qw, gs, n, k)) <= 1e-2, (v, m)
                assert torch.equal(outs[0], outs[1]), (v, m, used)
                if n == 3584 and _clusters_expected():
                    assert used[1] == 8, (v, m, used)
        kernel.set_variant("auto")
        kernel.set_v2_cluster(True)
        x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((8, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        kernel.linear(x, qw, gs, n, k, out=out)
        if n == 3584 and _clusters_expected():
            assert int(ext.last_v2_cluster()) == int(ext.last_v2_grid()) // 28 == 8
        assert _replay_equals_eager(lambda: kernel.linear(x, qw, gs, n, k, out=out), out)
    finally:
        kernel.set_v2_cluster(cluster_before)
        kernel.set_variant(before)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3584, 18944), (37888, 3584), (2000, 4032)])
def test_gpu_v2_prefetch_bit_identical(n, k):
    """In a build with it (-DQERL_V2_PREFETCH_LOOP; elsewhere a distance is refused), the stream-K kernels'
    rolling L2 prefetch (set_v2_prefetch) changes no value: bit-identical outputs with
    distances 0, 8, 16 and 40 tiles, every stream-K variant, aligned and stream-K grids (a CTA crossing row
    groups: segments after the first), M up to 64, the SiLU·mul pair kernel too, outputs poisoned; a distance
    outside 0 ... 255 is refused."""
    _need_kernel()
    ext = kernel._load()
    if not ext.has_v2_prefetch():
        with pytest.raises(RuntimeError, match="no rolling L2 prefetch"):
            kernel.set_v2_prefetch(8)
        assert int(ext.get_v2_prefetch()) == 0
        pytest.skip("a build without -DQERL_V2_PREFETCH_LOOP (gpu_session part 73 builds one)")
    before, aligned_before, pf_before = kernel.variant(), bool(ext.get_v2_aligned()), int(ext.get_v2_prefetch())
    qw, gs = make_packed(n, k, device="cuda", seed=5 * n + k)
    try:
        with pytest.raises(ValueError):
            kernel.set_v2_prefetch(256)
        for v in ("v2", "v2w8", "v2w10"):
            kernel.set_variant(v)
            for aligned in (True, False):
                kernel.set_v2_aligned(aligned)
                for m in (1, 8, 16, 33):
                    if v == "v2w10" and m > 16:
                        continue
                    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                    outs, pairs = [], []
                    for pf in (0, 8, 16, 40):
                        kernel.set_v2_prefetch(pf)
                        assert int(ext.get_v2_prefetch()) == pf
                        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                        kernel.linear(x, qw, gs, n, k, out=out)
                        outs.append(out)
                        if v != "v2" and n % 32 == 0:
                            pairs.append(kernel.linear_silu(x, qw, gs, n, k))
                    torch.cuda.synchronize()
                    assert not torch.isnan(outs[0]).any(), (v, aligned, m)
                    assert rel_err(outs[0], ref_fp32(x, qw, gs, n, k)) <= 1e-2, (v, aligned, m)
                    for o in outs[1:]:
                        assert torch.equal(o, outs[0]), (v, aligned, m)
                    if pairs and pairs[0] is not None:
                        for o in pairs[1:]:
                            assert o is not None and torch.equal(o, pairs[0]), (v, aligned, m)
    finally:
        kernel.set_v2_prefetch(pf_before)
        kernel.set_v2_aligned(aligned_before)
        kernel.set_variant(before)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3584, 18944), (3584, 3584), (4608, 3584), (5120, 27648), (7168, 5120),
                                 (2000, 4032)])
def test_gpu_v2_aligned_grid(n, k):
    """Row-group-aligned grids (session 21): at M <= 16 the stream-K kernels run RG * s CTAs (RG row groups of 128
    rows for v2w8, 64 for v2) where that fills the GPU, every CTA inside one row group's K range; both grids agree
    with the fp32 reference at every M, outputs poisoned, and off, the grid is the default one. (2000, 4032): a
    ragged last row group and K tiles (63) that few splits divide."""
    _need_kernel()
    ext = kernel._load()
    before, aligned_before = kernel.variant(), bool(ext.get_v2_aligned())
    qw, gs = make_packed(n, k, device="cuda", seed=n + k)
    try:
        for v, rows in (("v2w8", 128), ("v2", 64)):
            kernel.set_variant(v)
            rg = -(-n // rows)
            for m in (1, 3, 8, 9, 16, 17):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = ref_fp32(x, qw, gs, n, k)
                grids = []
                for aligned in (True, False):
                    kernel.set_v2_aligned(aligned)
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    kernel.linear(x, qw, gs, n, k, out=out)
                    grids.append(int(ext.last_v2_grid()))
                    torch.cuda.synchronize()
                    assert not torch.isnan(out).any() and rel_err(out, ref) <= 1e-2, (v, m, aligned)
                if m <= 16 and grids[0] != grids[1]:
                    assert grids[0] % rg == 0, (v, m, grids)  # aligned: RG * s
                if m > 16:
                    assert grids[0] == grids[1], (v, m, grids)  # (only up to M = 16)
            if (n, k) == (3584, 18944) and v == "v2w8":  # 7B down fills the GPU aligned (RG = 28)
                kernel.set_v2_aligned(True)
                kernel.linear(torch.randn(8, k, device="cuda", dtype=torch.bfloat16), qw, gs, n, k)
                p = int(ext.last_v2_grid())
                assert p % 28 == 0 and 4 * p >= 3 * torch.cuda.get_device_properties(0).multi_processor_count, p
    finally:
        kernel.set_v2_aligned(aligned_before)
        kernel.set_variant(before)


@pytest.mark.gpu
def test_gpu_path_choice():
    """auto: the mma kernel up to M = 64 except small weights from M = 32 (dequantize + cuBLAS measured faster),
    where the K splits of a small weight reduce in thread-block clusters up to the cluster M limit (32 by default,
    sm_90): there the mma kernel measured faster."""
    _need_kernel()
    ext = kernel._load()
    before_cluster, before_max_m = bool(ext.get_cluster()), int(ext.get_cluster_max_m())
    sm90 = torch.cuda.get_device_capability()[0] >= 9
    try:
        ext.set_cluster_max_m(32)
        kernel.set_cluster(True)
        assert ext.choose_path(16, 4608, 3584) == 0
        assert ext.choose_path(32, 4608, 3584) == (0 if sm90 else 1)
        assert ext.choose_path(33, 4608, 3584) == 1
        kernel.set_cluster(False)
        assert ext.choose_path(32, 4608, 3584) == 1
        assert ext.choose_path(64, 37888, 3584) == 0 and ext.choose_path(128, 37888, 3584) == 0
        assert ext.choose_path(129, 37888, 3584) == 1 and ext.choose_path(65, 4608, 3584) == 1
    finally:
        ext.set_cluster_max_m(before_max_m)
        kernel.set_cluster(before_cluster)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(3584, 18944), (7168, 5120), (5000, 64)])
def test_gpu_v2_fixups_bit_identical(n, k):
    """The v2 kernels' two stream-K fixups (batched: 4 elements x 8 slots in flight; serial: one element, four
    slots) add the same partials in the same order: bit-identical outputs, at every M up to 64 (the stream-K
    kernel ran: ``last_split`` 0), both warp counts."""
    _need_kernel()
    ext = kernel._load()
    before = kernel.variant()
    qw, gs = make_packed(n, k, device="cuda", seed=n + 3 * k)
    try:
        for v in ("v2", "v2w8"):
            kernel.set_variant(v)
            for m in (1, 2, 3, 8, 9, 16, 17, 32, 33, 64):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                outs = []
                for mode in (1, 2, 0):
                    ext.set_fixup(mode)
                    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                    kernel.linear(x, qw, gs, n, k, out=out)
                    assert int(ext.last_split()) == 0, (v, m)
                    outs.append(out)
                torch.cuda.synchronize()
                assert not torch.isnan(outs[0]).any() and rel_err(outs[0], ref_fp32(x, qw, gs, n, k)) <= 1e-2
                assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (v, m)
        with pytest.raises(RuntimeError, match="fixup must be"):
            ext.set_fixup(3)
    finally:
        ext.set_fixup(0)
        kernel.set_variant(before)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(37888, 3584), (3072, 576), (512, 256), (64, 4096), (55296, 5120), (7168, 3584)])
def test_gpu_linear_silu_equals_product_then_silu_mul(n, k):
    """Pair mode (kernel.linear_silu, a fused gate/up weight: gate rows first): silu(gate) * up from one launch is
    bit-identical to the v2w8 (or v2w10) product of the block-interleaved weight (gate block j, up block j, ...: the
    same stream-K split) rounded to bf16, then qerl_fused's silu_mul; within bf16 rounding of the plain weight's route
    (rows cut between blocks are summed in another order). Every M up to 64 (output poisoned: every element
    written), row groups cut between CTAs (the fixup) and whole ones, one CUDA graph replay. Where linear would
    not run the small-M kernel (choose_path), linear_silu declines."""
    from qerl_cli import fused

    _need_kernel()
    assert fused.available(), fused.build_error()
    ext = kernel._load()
    before = kernel.variant()
    qw, gs = make_packed(n, k, device="cuda", seed=n ^ k)
    nt = n // 16
    perm = torch.stack([torch.arange(nt // 2), torch.arange(nt // 2) + nt // 2], 1).reshape(-1).to("cuda")
    qwi = qw[perm].contiguous()  # block-interleaved: record rows 2j = gate block j, 2j + 1 = up block j
    try:
        for variant in ("v2w8", "v2w10"):  # (v2w10 runs the 8-warp instances above M = 16, in both routes)
            kernel.set_variant(variant)
            for m in (1, 2, 3, 8, 9, 13, 16, 17, 32, 33, 40, 64):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                yi = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                assert int(ext.linear_out(x, qwi, kernel._gs(gs), n, k, yi, 0, None)) == 0
                halves = yi.view(m, nt // 2, 2, 16)
                expect = fused.silu_mul(halves[:, :, 0].reshape(m, n // 2), halves[:, :, 1].reshape(m, n // 2))
                y = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                assert int(ext.linear_out(x, qw, kernel._gs(gs), n, k, y, 0, None)) == 0
                plain = fused.silu_mul(y[:, : n // 2], y[:, n // 2:])
                out = torch.full((m, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
                assert ext.linear_silu_out(x, qw, kernel._gs(gs), n, k, out)
                torch.cuda.synchronize()
                assert not torch.isnan(expect).any() and torch.equal(out, expect), (n, k, m)
                assert rel_err(out, plain) <= 1e-2, (n, k, m)
                with torch.no_grad():
                    got = kernel.linear_silu(x, qw, gs, n, k)
                if ext.choose_path(m, n, k) == 0:
                    assert got is not None and torch.equal(got, expect), (n, k, m)
                else:
                    assert got is None, (n, k, m)
        x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((8, n // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
        ext.linear_silu_out(x, qw, kernel._gs(gs), n, k, out)  # (workspace and counters before the capture)
        assert _replay_equals_eager(lambda: ext.linear_silu_out(x, qw, kernel._gs(gs), n, k, out), out)
    finally:
        kernel.set_variant(before)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(37888, 3584), (3072, 576), (7168, 3584)])
def test_gpu_linear_silu_with_lora_term(n, k):
    """(session 22) Pair mode with a LoRA term (kernel.linear_silu with hs, bs): the term of each physical row
    (gate row r or up row r) is added before the SiLU. Bit-identical to linear_lora on the block-interleaved weight
    with bs's columns interleaved alike, then silu_mul; with a block-diagonal bs (the gate and up members' rank
    rows, segs) within bf16 rounding of the fp32 reference silu(x Wg^T + hs Bg) * (x Wu^T + hs Bu). Every M up to
    64 that runs the small-M kernels (it declines where linear takes dequantize + cuBLAS), outputs poisoned, v2w8 and
    v2w10 forced; a CUDA graph replay; hs without bs is refused."""
    _need_kernel()
    ext = kernel._load()
    qw, gs = make_packed(n, k, device="cuda", seed=n + 3 * k)
    nt, half = n // 16, n // 2
    perm = torch.stack([torch.arange(nt // 2), torch.arange(nt // 2) + nt // 2], 1).reshape(-1).to("cuda")
    qwi = qw[perm].contiguous()
    cols = (perm[:, None] * 16 + torch.arange(16, device="cuda")).reshape(-1)  # the interleaved weight's row order
    w32 = layout.dequantize(qw, gs, n, k, torch.float32)
    scale = float(w32.abs().mean()) * k ** 0.5  # (a term as large as the product: a misplaced one shows)
    before = kernel.variant()
    try:
        for variant in ("v2w8", "v2w10"):
            kernel.set_variant(variant)
            _silu_lora_cases(ext, qw, qwi, gs, w32, cols, n, k, scale)
    finally:
        kernel.set_variant(before)
    x = torch.randn(8, k, device="cuda", dtype=torch.bfloat16)
    hs = torch.randn(8, 32, device="cuda").bfloat16().float()
    bs = (torch.randn(32, n, device="cuda") * scale / 32 ** 0.5).bfloat16()
    out = torch.full((8, half), float("nan"), device="cuda", dtype=torch.bfloat16)
    assert ext.linear_silu_out(x, qw, kernel._gs(gs), n, k, out, hs, bs, [])
    assert _replay_equals_eager(lambda: ext.linear_silu_out(x, qw, kernel._gs(gs), n, k, out, hs, bs, []), out)
    with torch.no_grad(), pytest.raises(ValueError, match="together"):
        kernel.linear_silu(x, qw, gs, n, k, hs, None)
    assert not ext.linear_silu_out(x, qw, kernel._gs(gs), n, k, out, hs, bs[:, :-16].contiguous(), [])  # bs width


def _silu_lora_cases(ext, qw, qwi, gs, w32, cols, n, k, scale) -> None:
    """test_gpu_linear_silu_with_lora_term's checks at every M, under the variant in force."""
    from qerl_cli import fused

    nt, half = n // 16, n // 2
    for m in (1, 3, 8, 9, 16, 17, 33, 64):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        hs = torch.randn(m, 32, device="cuda").bfloat16().float()
        bs = (torch.randn(32, n, device="cuda") * scale / 32 ** 0.5).bfloat16()
        if ext.choose_path(m, n, k) != 0:  # (dequantize + cuBLAS there: neither small-M route runs)
            with torch.no_grad():
                assert kernel.linear_silu(x, qw, gs, n, k, hs, bs) is None, (n, k, m)
            continue
        yi = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            assert kernel.linear_lora(x, qwi, gs, n, k, hs, bs[:, cols].contiguous(), out=yi) is not None
        halves = yi.view(m, nt // 2, 2, 16)
        expect = fused.silu_mul(halves[:, :, 0].reshape(m, half), halves[:, :, 1].reshape(m, half))
        with torch.no_grad():
            got = kernel.linear_silu(x, qw, gs, n, k, hs, bs)
        assert got is not None and not torch.isnan(expect).any() and torch.equal(got, expect), (n, k, m)
        # block-diagonal: gate columns read rank rows 0-15, up columns 16-31
        bd = bs.clone()
        bd[16:, :half] = 0
        bd[:16, half:] = 0
        segs = (half, 0, 16, n, 16, 32)
        with torch.no_grad():
            got = kernel.linear_silu(x, qw, gs, n, k, hs, bd, segs)
        y32 = x.float() @ w32.t() + hs @ bd.float()
        ref = torch.nn.functional.silu(y32[:, :half]) * y32[:, half:]
        assert got is not None and rel_err(got, ref) <= 1e-2, (n, k, m, rel_err(got, ref))


@pytest.mark.gpu
def test_gpu_linear_silu_declines():
    """linear_silu runs only where linear would run v2w8 on the small-M path: None (nothing computed) for more than
    64 rows, a non-bf16 x, another variant forced, n not a multiple of 32, or with autograd on."""
    _need_kernel()
    before = kernel.variant()
    qw, gs = make_packed(512, 256, device="cuda")
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    try:
        kernel.set_variant("v2w8")
        with torch.no_grad():
            assert kernel.linear_silu(x, qw, gs, 512, 256) is not None
            assert kernel.linear_silu(torch.randn(65, 256, device="cuda", dtype=torch.bfloat16), qw, gs, 512,
                                      256) is None
            assert kernel.linear_silu(x.half(), qw, gs, 512, 256) is None
            qw48, gs48 = make_packed(48, 256, device="cuda")
            assert kernel.linear_silu(x, qw48, gs48, 48, 256) is None
            kernel.set_variant("default")
            assert kernel.linear_silu(x, qw, gs, 512, 256) is None
        kernel.set_variant("v2w8")
        assert kernel.linear_silu(x, qw, gs, 512, 256) is None  # (grad mode)
    finally:
        kernel.set_variant(before)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(37888, 3584), (3584, 18944), (4608, 3584), (16, 64), (64, 4096), (5000, 64)])
def test_gpu_v2_matches_default(n, k):
    """v2 and the default kernel: same A fragments, only the fp32 summation order differs (M up to 64). The mma
    path is forced (path 0): above M = 32 auto sends small weights to dequantize + cuBLAS."""
    _need_kernel()
    ext = kernel._load()
    before = kernel.variant()
    qw, gs = make_packed(n, k, device="cuda", seed=n + k)
    try:
        for m in (1, 2, 7, 8, 9, 16, 17, 31, 33, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            outs = {}
            for v in ("default", "v2", "v2w8"):
                kernel.set_variant(v)
                outs[v] = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                assert int(ext.linear_out(x, qw, kernel._gs(gs), n, k, outs[v], 0, None)) == 0, (v, m)
            torch.cuda.synchronize()
            ref = ref_fp32(x, qw, gs, n, k)
            for v in ("v2", "v2w8"):
                assert not torch.isnan(outs[v]).any(), (v, n, k, m)
                assert rel_err(outs[v], ref) <= 1e-2
                assert rel_err(outs[v], outs["default"]) <= 1e-2
    finally:
        kernel.set_variant(before)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (200, 80), (3584, 18944)])
def test_gpu_bias_epilogue_bit_exact(n, k, small_m_variant):
    """The bias added in the kernel's epilogue (direct write and split-K reduction) equals ``linear + bias``."""
    qw, gs = make_packed(n, k, device="cuda", seed=n + k)
    b = (torch.randn(n, device="cuda") * 4).to(torch.bfloat16)
    for m in (1, 5, 8, 13, 16, 33, 64, 65, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        kernel.linear(x, qw, gs, n, k, out=out, bias=b)
        assert torch.equal(out, kernel.linear(x, qw, gs, n, k) + b), (n, k, m)


def _pdl_chain(x, weights, pdl: bool, graph: bool):
    """x through a chain of packed linears (each output the next one's input), PDL on or off, eager or in a
    CUDA graph; returns the last output."""
    kernel.set_pdl(pdl)
    try:
        def run():
            h = x
            for qw, gs, n, k in weights:
                h = kernel.linear(h, qw, gs, n, k)
            return h
        if not graph:
            return run().clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            run()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = run()
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        return y.clone()
    finally:
        kernel.set_pdl(True)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_pdl_chain_identical(m, small_m_variant):
    """Programmatic dependent launch changes timing only: a chain of dependent small-M linears (split-K and
    stream-K ones included) gives bit-identical results with it on and off, eager and in a CUDA graph."""
    shapes = [(4608, 3584), (3584, 4608), (18944, 3584), (3584, 18944), (576, 3584)]
    weights = [(*make_packed(n, k, device="cuda", seed=i), n, k) for i, (n, k) in enumerate(shapes)]
    x = torch.randn(m, 3584, device="cuda", dtype=torch.bfloat16) * 0.05
    base = _pdl_chain(x, weights, pdl=False, graph=False)
    assert not torch.isnan(base).any()
    for graph in (False, True):
        assert torch.equal(_pdl_chain(x, weights, pdl=True, graph=graph), base), graph


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944), (200, 80), (5000, 256)])
@pytest.mark.parametrize("variant", ["default", "alt"])
@pytest.mark.parametrize("cluster_max_m", [16, 128])
def test_gpu_cluster_split_equals_workspace_split(n, k, variant, cluster_max_m):
    """The split-K reduction through thread-block clusters (distributed shared memory) and the one through the
    fp32 workspace add the same partials in the same order: bit-identical outputs at equal splits (forced),
    with and without bias; each launch took the path it says it took (clusters up to the cluster M limit, the
    workspace above; the limit raised to 128 covers every configuration and token slices at M > 64)."""
    _need_kernel()
    ext = kernel._load()
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("thread-block clusters need sm_90")
    qw, gs = make_packed(n, k, device="cuda", seed=n + 3 * k)
    b = (torch.randn(n, device="cuda") * 2).to(torch.bfloat16)
    kt = (k + 63) // 64
    before = kernel.variant()
    before_cluster, before_max_m = bool(ext.get_cluster()), int(ext.get_cluster_max_m())
    kernel.set_variant(variant)
    ext.set_cluster_max_m(cluster_max_m)
    try:
        for split in sorted({2, 3, min(8, kt)}):
            ext.set_split_override(split)
            for m in (1, 5, 8, 16, 33, 64, 70):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                outs = {}
                for cl in (True, False):
                    kernel.set_cluster(cl)
                    for bias in (None, b):
                        o = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                        ext.linear_out(x, qw, gs, n, k, o, 0, bias)
                        last = int(ext.last_split())
                        assert abs(last) >= 2 and (last < 0) == (cl and m <= cluster_max_m), (split, m, cl, last)
                        outs[cl, bias is None] = o
                torch.cuda.synchronize()
                for nb in (True, False):
                    assert not torch.isnan(outs[True, nb]).any(), (split, m)
                    assert torch.equal(outs[True, nb], outs[False, nb]), (n, k, split, m, nb)
                assert rel_err(outs[True, True], ref_fp32(x, qw, gs, n, k)) <= 1e-2
    finally:
        ext.set_split_override(0)
        ext.set_cluster_max_m(before_max_m)
        kernel.set_cluster(before_cluster)
        kernel.set_variant(before)


@pytest.mark.gpu
def test_gpu_pdl_weight_written_just_before():
    """A kernel launched with PDL only prefetches into L2 before the previous kernel is done: a weight buffer
    that the kernel right before rewrites is read with its new values."""
    _need_kernel()
    n, k, m = 4608, 3584, 8
    packs = [make_packed(n, k, device="cuda", seed=s) for s in range(4)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    expect = [kernel.linear(x, qw, gs, n, k) for qw, gs in packs]
    buf, gbuf = torch.empty_like(packs[0][0]), torch.empty_like(packs[0][1])
    for rep in range(3):
        for i, (qw, gs) in enumerate(packs):
            buf.copy_(qw)
            gbuf.copy_(gs)
            assert torch.equal(kernel.linear(x, buf, gbuf, n, k), expect[i]), (rep, i)


@pytest.fixture
def tiled_ext():
    """The extension, with the tiled kernel's settings (tile, K split, auto M limit) restored afterwards."""
    _need_kernel()
    ext = kernel._load()
    before = kernel.tc_max_m()
    yield ext
    ext.set_tc_cfg(0)
    ext.set_tc_split(0)
    ext.set_tc_max_m(before)


def _tc_cfgs(ext) -> tuple[tuple[int, ...], ...]:
    """The tiled configurations this device runs, by family (outputs are bit-identical within one): mma.sync 1-3,
    and wgmma 4-7 where the device is cc 9.0 and the build carries sm_90a code."""
    return ((1, 2, 3), (4, 5, 6, 7)) if ext.wgmma_available(torch.cuda.current_device()) else ((1, 2, 3),)


def _tc_split(want: int, kt: int) -> int:
    """The K split a forced ``set_tc_split(want)`` runs: the nearest one that leaves no split empty."""
    want = min(want, kt)
    tps = -(-kt // want)
    return -(-kt // tps)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(576, 576), (200, 80), (17, 48), (1000, 1008), (4608, 3584), (3584, 18944)])
def test_gpu_tiled_kernel_every_tile_and_split(n, k, tiled_ext):
    """Path 2, the tiled tensor-core kernels, under each tile configuration (mma.sync 1-3; wgmma 4-7 on an sm_90a
    device) and K splits 1-3 (and the chosen one): every output is written (poisoned with NaN first) and within
    1e-2 of the fp32 product, also for ragged M, N not a multiple of 8 (scalar stores) and K not a multiple of 64;
    at one forced split the tiles of one family give the same bits (every output adds the same MMAs in the same
    order) and a repeat gives them again (the split-K tickets reset themselves); the bias epilogue equals
    bf16(bf16(x W^T) + bias) bit for bit."""
    ext = tiled_ext
    families = _tc_cfgs(ext)
    qw, gs = make_packed(n, k, device="cuda", seed=n + k)
    kt = -(-k // 64)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    for m in (1, 7, 64, 65, 129, 300):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = ref_fp32(x, qw, gs, n, k)
        for split in (1, 2, 3, 0):
            ext.set_tc_split(split)
            outs = {}
            for cfg in sum(families, ()):
                ext.set_tc_cfg(cfg)
                out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                assert int(ext.linear_out(x, qw, gs, n, k, out, 2)) == 2
                torch.cuda.synchronize()
                last = int(ext.last_tc())
                assert last // 1000 == cfg
                if split:
                    assert last % 1000 == _tc_split(split, kt), (m, split, cfg, last)
                assert not torch.isnan(out).any(), f"unwritten output at m={m} split={split} tile={cfg}"
                e = rel_err(out, ref)
                assert e <= 1e-2, f"rel err {e:.2e} at m={m} split={split} tile={cfg}"
                outs[cfg] = out
                if split:
                    again = torch.full_like(out, float("nan"))
                    ext.linear_out(x, qw, gs, n, k, again, 2)
                    assert torch.equal(again, out), (m, split, cfg)
                    ob = torch.full_like(out, float("nan"))
                    ext.linear_out(x, qw, gs, n, k, ob, 2, bias)
                    assert torch.equal(ob, (out.float() + bias.float()).to(torch.bfloat16)), (m, split, cfg)
            if split:
                for fam in families:
                    assert all(torch.equal(outs[fam[0]], outs[c]) for c in fam[1:]), (m, split, fam)


@pytest.mark.gpu
def test_gpu_tiled_kernel_misaligned_out(tiled_ext):
    """An ``out`` that is a contiguous view 2 bytes past a 16-byte boundary: the tiled kernel's epilogue stores
    element by element there (its 16-byte stores would fault) and writes the same bits."""
    ext = tiled_ext
    n, k, m = 576, 576, 100
    qw, gs = make_packed(n, k, device="cuda", seed=5)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ext.set_tc_split(1)
    for fam in _tc_cfgs(ext):
        ext.set_tc_cfg(fam[0])
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        ext.linear_out(x, qw, gs, n, k, out, 2)
        buf = torch.full((m * n + 1,), float("nan"), device="cuda", dtype=torch.bfloat16)
        view = buf[1:].view(m, n)
        assert view.data_ptr() % 16 != 0
        ext.linear_out(x, qw, gs, n, k, view, 2)
        torch.cuda.synchronize()
        assert torch.equal(view, out) and torch.isnan(buf[0]), fam[0]


@pytest.mark.gpu
def test_gpu_tiled_path_choice(tiled_ext):
    """The auto path gives the tiled kernel large_m_threshold() < M <= tc_max_m() (0: never) and says so."""
    ext = tiled_ext
    n, k = 4608, 3584
    ext.set_tc_max_m(0)
    assert ext.choose_path(65, n, k) == 1 and ext.choose_path(512, n, k) == 1
    kernel.set_tc_max_m(512)
    assert kernel.tc_max_m() == 512 and kernel.settings()["tc_max_m"] == 512
    assert ext.choose_path(64, 37888, 3584) == 0
    assert ext.choose_path(65, n, k) == 2 and ext.choose_path(512, n, k) == 2 and ext.choose_path(513, n, k) == 1
    qw, gs = make_packed(n, k, device="cuda", seed=3)
    x = torch.randn(100, k, device="cuda", dtype=torch.bfloat16)
    y = kernel.linear(x, qw, gs, n, k)
    assert kernel.last_backend() == kernel.BACKEND_TILED
    assert rel_err(y, ref_fp32(x, qw, gs, n, k)) <= 1e-2
    kernel.linear(x.float(), qw, gs, n, k)  # fp32 x: dequantize + cuBLAS whatever the M
    assert kernel.last_backend() == kernel.BACKEND_DEQUANT
    with pytest.raises(ValueError, match="tc_max_m must be >= 0"):
        kernel.set_tc_max_m(-1)
    with pytest.raises(RuntimeError, match="tiled configuration"):
        ext.set_tc_cfg(8)
    # the wgmma tiles: on a cc 9.0 device with sm_90a code in the build (the default arch flags carry it)
    flags = os.environ.get("QERL_KERNEL_ARCH_FLAGS") or " ".join(kernel._DEFAULT_ARCH_FLAGS)
    dev = torch.cuda.current_device()
    assert ext.wgmma_available(dev) == (torch.cuda.get_device_capability(dev) == (9, 0) and "sm_90a" in flags)
    ext.set_tc_cfg(0)
    for m, wg_cfg, mma_cfg in ((64, 6, 3), (100, 4, 1)):
        ext.linear_out(x[:1].expand(m, k).contiguous(), qw, gs, n, k, torch.empty(m, n, device="cuda",
                                                                                  dtype=torch.bfloat16), 2)
        assert int(ext.last_tc()) // 1000 == (wg_cfg if ext.wgmma_available(dev) else mma_cfg), m


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(576, 1536), (200, 80), (4608, 3584), (3584, 18944)])
def test_gpu_linear_mid_m_both_paths(n, k):
    _need_kernel()
    _check_linear(n, k, MID_M, seed=n + 3 * k, paths=(None, 0, 1, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(576, 576), (3584, 3584), (4608, 3584)])
def test_gpu_linear_large_m(n, k):
    _need_kernel()
    _check_linear(n, k, [2048, 4095, 8192], seed=k, paths=(None, 0, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["codes", "tiny"])
def test_gpu_linear_all_codes_and_subnormal_scales(kind, small_m_variant):
    n, k = 1000, 1024
    qw, gs = make_packed(n, k, device="cuda", seed=11, kind=kind)
    if kind == "tiny":  # most block scales are e4m3 subnormals
        s = layout.unpack(qw, n, k)[1].float()
        assert (s[1:] < 2.0 ** -6).float().mean() > 0.5
    for m in (1, 8, 16, 40, 300):
        for path in (0, 1, 2):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            kernel._load().linear_out(x, qw, gs, n, k, out, path)
            ref = ref_fp32(x, qw, gs, n, k)
            assert not torch.isnan(out).any()
            # element-wise against the condition of each dot product (sum |x||w|): every output feature
            # must be right, including those of tiny-scaled blocks and those with cancellation
            w = layout.dequantize(qw, gs, n, k, torch.float32)
            bound = x.float().abs() @ w.abs().t()
            worst = float(((out.float() - ref).abs() / bound.clamp_min(1e-30)).max())
            assert worst <= 1e-2, (m, path, worst)
            assert rel_err(out, ref) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(200, 80), (960, 576), (3584, 18944), (37888, 3584)])
def test_gpu_dequantize_bit_exact(n, k):
    _need_kernel()
    qw, gs = make_packed(n, k, device="cuda", seed=1, kind="codes" if n < 1000 else "randn")
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        d = kernel.dequantize(qw, gs, n, k, dt)
        assert kernel.last_backend() == kernel.BACKEND_KERNEL
        r = layout.dequantize(qw, gs, n, k, dt)
        assert torch.equal(d, r), f"dequantize {dt} differs at {(n, k)}"


@pytest.mark.gpu
def test_gpu_dequantize_many_bit_exact():
    """Several weights (more than the 8 of one launch, odd row counts, SmolLM2's and 7B shapes) into one
    NaN-poisoned buffer: each block bit-exact with dequantize, every element written, nothing past the end."""
    _need_kernel()
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536), (17, 48), (200, 80), (4608, 3584), (1, 64),
              (33, 1600), (37888, 3584)]
    packed = [make_packed(n, k, device="cuda", seed=30 + i, kind="codes" if n * k < 1e7 else "randn")
              for i, (n, k) in enumerate(shapes)]
    total = sum(n * k for n, k in shapes)
    out = torch.full((total + 64,), float("nan"), dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="elements"):
        kernel._load().dequantize_many_out([q for q, _ in packed], [g for _, g in packed],
                                           [n for n, _ in shapes], [k for _, k in shapes], out)
    kernel._load().dequantize_many_out([q for q, _ in packed], [g for _, g in packed], [n for n, _ in shapes],
                                       [k for _, k in shapes], out[:total])
    assert torch.isnan(out[total:]).all()
    at = 0
    for (q, g), (n, k) in zip(packed, shapes):
        assert torch.equal(out[at: at + n * k].view(n, k), kernel.dequantize(q, g, n, k)), (n, k)
        at += n * k
    ws = kernel.dequantize_many([(q, g, n, k) for (q, g), (n, k) in zip(packed, shapes)])
    assert kernel.last_backend() == kernel.BACKEND_KERNEL
    assert all(torch.equal(w, out[a: a + w.numel()].view_as(w)) for w, a in
               zip(ws, [sum(n * k for n, k in shapes[:i]) for i in range(len(shapes))]))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(576, 1536), (200, 80), (3584, 18944), (4608, 3584)])
def test_gpu_linear_t(n, k):
    _need_kernel()
    qw, gs = make_packed(n, k, device="cuda", seed=2)
    w = layout.dequantize(qw, gs, n, k, torch.float32)
    for m in (1, 7, 64, 513, 4096):
        g = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
        out = kernel.linear_t(g, qw, gs, n, k)
        assert kernel.last_backend() == kernel.BACKEND_DEQUANT
        assert not torch.isnan(out).any()
        assert rel_err(out, g.float() @ w) <= 1e-2


@pytest.mark.gpu
def test_gpu_batched_dtypes_autograd_and_opcheck():
    _need_kernel()
    n, k = 960, 576
    qw, gs = make_packed(n, k, device="cuda", seed=4)
    w = layout.dequantize(qw, gs, n, k, torch.float32)
    x = torch.randn(2, 3, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = kernel.linear(x, qw, gs, n, k)
    assert y.shape == (2, 3, n) and kernel.last_backend() == kernel.BACKEND_KERNEL
    assert rel_err(y, x.detach().float() @ w.t()) <= 1e-2
    gy = torch.randn_like(y)
    y.backward(gy)
    assert rel_err(x.grad, gy.float() @ w) <= 1e-2
    for dt in (torch.float16, torch.float32):  # other activation dtypes: dequantize + cuBLAS
        xf = torch.randn(5, k, device="cuda", dtype=dt)
        yf = kernel.linear(xf, qw, gs, n, k)
        assert yf.dtype == dt and kernel.last_backend() == kernel.BACKEND_DEQUANT
        assert rel_err(yf, xf.float() @ w.t()) <= 1e-2
    xs = torch.randn(6, 2 * k, device="cuda", dtype=torch.bfloat16)[:, ::2]  # non-contiguous
    assert rel_err(kernel.linear(xs, qw, gs, n, k), xs.float() @ w.t()) <= 1e-2
    xo = torch.randn(4, k, device="cuda", dtype=torch.bfloat16)
    torch.library.opcheck(torch.ops.qerl.linear.default, (xo, qw, gs, n, k))
    torch.library.opcheck(torch.ops.qerl.linear_t.default, (torch.randn(4, n, device="cuda",
                                                                       dtype=torch.bfloat16), qw, gs, n, k))
    torch.library.opcheck(torch.ops.qerl.dequantize.default, (qw, gs, n, k, torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [4, 13])
def test_gpu_cuda_graph_and_repeat_determinism(m, small_m_variant):
    n, k = 3584, 18944  # split-K / stream-K path (ticket counters)
    qw, gs = make_packed(n, k, device="cuda", seed=9)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    first = kernel.linear(x, qw, gs, n, k)
    for _ in range(3):
        assert torch.equal(kernel.linear(x, qw, gs, n, k), first)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kernel.linear(x, qw, gs, n, k)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = kernel.linear(x, qw, gs, n, k)
    for _ in range(3):
        y.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, first)


def _torch_check_args(src: str):
    """The argument lists of every TORCH_CHECK( ... ) call in C++ source, split at top-level commas."""
    at = 0
    while (at := src.find("TORCH_CHECK(", at)) >= 0:
        i, depth, args, cur, quote = at + len("TORCH_CHECK("), 1, [], "", False
        while depth:
            c = src[i]
            if quote:
                cur += c
                if c == "\\":
                    cur += src[i + 1]
                    i += 1
                elif c == '"':
                    quote = False
            elif c == '"':
                quote, cur = True, cur + c
            elif c in "([{":
                depth, cur = depth + 1, cur + c
            elif c in ")]}":
                depth -= 1
                cur += c if depth else ""
            elif c == "," and depth == 1:
                args.append(cur.strip())
                cur = ""
            else:
                cur += c
            i += 1
        args.append(cur.strip())
        yield src[:at].count("\n") + 1, args
        at = i


def test_extension_checks_never_stream_numbers_into_messages():
    """Every TORCH_CHECK message in csrc/*.cu is string literals only: on the H200 a failing check whose message
    streamed an integer killed the process (session 8); QERL_CHECK (csrc/check.cuh) formats with snprintf."""
    import re

    csrc = Path(__file__).resolve().parents[1] / "csrc"
    checked = 0
    for path in sorted(csrc.glob("*.cu")):
        for line, args in _torch_check_args(path.read_text()):
            message = args[1:]
            assert message, f"{path.name}:{line}: TORCH_CHECK without a message"
            assert all(re.fullmatch(r'("([^"\\]|\\.)*"\s*)+', a) for a in message), (
                f"{path.name}:{line}: TORCH_CHECK message is not string literals only (use QERL_CHECK): {message}")
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_linear_on_cpu_is_the_reference(dtype):
    """(review, session 27) PackedLinear on CPU rounded its cached weight to a bf16 input's dtype before the
    product, unlike the reference and the kernel (the fp32 weight, one rounding of the product)."""
    from qerl_cli.packed_model import PackedLinear

    n, k = 64, 256
    qw, gs = make_packed(n, k, seed=11)
    mod = PackedLinear(qw, gs, n, k)
    x = torch.randn(8, k).to(dtype)
    for _ in range(2):  # the first call fills the cache, the second reads it
        assert torch.equal(mod(x), layout.reference_matmul(x, qw, gs, n, k))
    assert torch.equal(mod(x.float()), layout.reference_matmul(x.float(), qw, gs, n, k))
    # a model cast to bf16 keeps the fp32 tensor scale exact (bf16 would round it, e.g. 618.887 to 620)
    mod.global_scale.fill_(618.887)
    cast = mod.to(torch.bfloat16)
    assert cast.global_scale.dtype == torch.float32 and float(cast.global_scale) == float(torch.tensor(618.887))


def test_build_errors_say_why(monkeypatch):
    """The reason a build failed is the compiler's error line, not ninja's last words; an old GPU (below sm_80)
    is refused before building; QERL_DISABLE_KERNEL=0 does not disable the kernel."""
    msg = ("Error building extension 'qerl_nvfp4': [1/2] nvcc ... -c nvfp4_kernel.cu\nFAILED: nvfp4_kernel.cuda.o\n"
           "nvfp4_kernel.cu(120): error: identifier \"foo\" is undefined\n1 error detected\n"
           "ninja: build stopped: subcommand failed.")
    assert kernel.error_line(RuntimeError(msg)) == 'RuntimeError: nvfp4_kernel.cu(120): error: identifier "foo" is undefined'
    assert kernel.error_line(OSError("libcuda.so: cannot open")) == "OSError: libcuda.so: cannot open"
    monkeypatch.setenv("QERL_DISABLE_KERNEL", "1")
    with pytest.raises(RuntimeError, match="QERL_DISABLE_KERNEL is set"):
        kernel.build_extension("qerl_x", "nvfp4_kernel.cu")
    monkeypatch.setenv("QERL_DISABLE_KERNEL", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (7, 5))
    with pytest.raises(RuntimeError, match=r"compute capability 7\.5 is below 8\.0"):
        kernel.build_extension("qerl_x", "nvfp4_kernel.cu")
