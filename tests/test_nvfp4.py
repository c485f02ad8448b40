"""NVFP4 math (src/qerl_cli/nvfp4.py) against hand-computed numbers and against compressed-tensors 0.19."""

from __future__ import annotations

import math

import pytest
import torch

from qerl_cli import nvfp4

E4M3 = torch.float8_e4m3fn


def _unit_step(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block scales and tensor scale with s / G == 1, so codes are E2M1_round(W) directly."""
    return torch.ones(n, k // 16).to(E4M3), torch.tensor([1.0])


def _codes(values: list[float]) -> list[int]:
    """Codes of ``values`` quantized with step 1 (padded to one 16-wide block with zeros)."""
    row = torch.tensor(values + [0.0] * (16 - len(values) % 16 if len(values) % 16 else 0)).reshape(1, -1)
    s, g = _unit_step(1, row.shape[1])
    return nvfp4.quantize_codes(row, s, g)[0, : len(values)].tolist()


# ------------------------------------------------------------------------------------------ test vector


def test_design_test_vector():
    """DESIGN §3: W[i] = 0.02 * i * (-1)**i, i = 0..31, in bf16."""
    w = torch.tensor([0.02 * i * (-1) ** i for i in range(32)]).to(torch.bfloat16).reshape(1, 32)
    q = nvfp4.quantize_weight(w)
    g = q["weight_global_scale"]
    assert g.dtype == torch.float32 and tuple(g.shape) == (1,)
    assert float(g) == pytest.approx(4327.8491, abs=5e-4)
    # G is 2688 / amax, amax = bf16(0.62), computed as compressed-tensors does (python scalar / fp32 tensor)
    assert float(g) == float(2688.0 / w.float().abs().amax())
    assert q["weight_scale"].dtype == E4M3 and tuple(q["weight_scale"].shape) == (1, 2)
    assert q["weight_scale"].float().tolist() == [[224.0, 448.0]]
    assert q["weight_packed"].dtype == torch.uint8 and tuple(q["weight_packed"].shape) == (1, 16)
    assert bytes(q["weight_packed"][0].tolist()).hex() == "90a2c3d4d5e6f6f7d5e5e6e6e6f7f7f7"


# ------------------------------------------------------------------------------------------- rounding

# (input, expected E2M1 value): every tie goes to the even code (codes 0, 2, 4, 6 hold 0, 1, 2, 4).
TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("x,want", TIES)
def test_ties_round_to_even(x, want):
    codes = _codes([x, -x])
    vals = nvfp4.e2m1_decode(torch.tensor(codes)).tolist()
    assert vals == [want, -want]
    # the sign lives in bit 3, the magnitude index in bits 0..2 (a negative rounding to 0 keeps its sign)
    assert codes[0] < 8
    assert codes[1] == codes[0] | 8


@pytest.mark.parametrize("x,want", TIES)
def test_just_off_the_ties(x, want):
    """The fp32 neighbours of each threshold go to the nearer magnitude, whichever is even."""
    lo = max(m for m in nvfp4.E2M1_MAGNITUDES if m < x)
    hi = min(m for m in nvfp4.E2M1_MAGNITUDES if m > x)
    t = torch.tensor(x, dtype=torch.float32)
    below = float(torch.nextafter(t, torch.tensor(-math.inf)))
    above = float(torch.nextafter(t, torch.tensor(math.inf)))
    got = nvfp4.e2m1_decode(torch.tensor(_codes([below, above, -below, -above]))).tolist()
    assert got == [lo, hi, -lo, -hi]


def test_hand_codes_of_every_magnitude():
    vals = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert _codes(vals) == [0, 1, 2, 3, 4, 5, 6, 7]
    assert _codes([-v for v in vals[1:]]) == [9, 10, 11, 12, 13, 14, 15]
    assert nvfp4.e2m1_table().tolist() == vals + [-v for v in vals]


def test_clamp_at_six():
    assert _codes([6.0, 7.0, 100.0, 1e30, -6.0, -7.0, -1e30]) == [7, 7, 7, 7, 15, 15, 15]
    assert nvfp4.e2m1_encode(torch.tensor([math.inf, -math.inf])).tolist() == [7, 15]


def test_zero_block_gets_scale_0125():
    w = torch.zeros(2, 48)
    w[0, 16:32] = torch.linspace(-1, 1, 16)
    w[1, 40] = 0.3
    q = nvfp4.quantize_weight(w)
    s = q["weight_scale"].float()
    assert s[0, 0] == 0.125 and s[0, 2] == 0.125 and s[1, 0] == s[1, 1] == 0.125 and s[1, 2] != 0.125
    deq = nvfp4.dequantize(nvfp4.unpack_nibbles(q["weight_packed"]), q["weight_scale"], q["weight_global_scale"])
    assert torch.all(deq[0, :16] == 0) and torch.all(deq[0, 32:] == 0)


def test_all_zero_weight_is_finite_like_compressed_tensors():
    """An all-zero projection (pruned, or zero-initialised) must still give a loadable checkpoint.

    compressed-tensors' generate_gparam replaces the overflowing 448*6/tiny by 1.0; the scales are then 0 -> 0.125.
    """
    q = nvfp4.quantize_weight(torch.zeros(4, 32))
    assert torch.isfinite(q["weight_global_scale"]).all(), q["weight_global_scale"]
    assert torch.isfinite(q["weight_scale"].float()).all(), q["weight_scale"]
    assert q["weight_scale"].float().eq(0.125).all()
    assert torch.all(q["weight_packed"] == 0)
    g, s, packed = _ct_compress(torch.zeros(4, 32))
    assert torch.equal(q["weight_global_scale"], g.float().reshape(1))


def test_low_nibble_is_even_column():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = nvfp4.pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x43, 0x0F, 0x97]]
    assert torch.equal(nvfp4.unpack_nibbles(packed), codes)


def test_dequant_divides_by_global_scale():
    codes = torch.tensor([[7, 15, 1] + [0] * 13], dtype=torch.uint8)
    s = torch.tensor([[3.0]]).to(E4M3)
    g = torch.tensor([2.0])
    assert nvfp4.dequantize(codes, s, g)[0, :3].tolist() == [9.0, -9.0, 0.75]


def test_non_finite_and_bad_shapes_rejected():
    w = torch.randn(2, 32)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        nvfp4.quantize_weight(w)
    with pytest.raises(ValueError, match="multiple of 16"):
        nvfp4.quantize_weight(torch.randn(2, 24))
    with pytest.raises(ValueError):
        nvfp4.quantize_weight(torch.randn(32))


def test_fused_set_shares_one_global_scale():
    g = torch.Generator().manual_seed(1)
    ws = [torch.randn(32, 64, generator=g) * s for s in (0.5, 2.0, 1.0)]
    G = nvfp4.fused_global_scale(ws)
    assert float(G) == float(2688.0 / ws[1].abs().amax())
    for w in ws:
        q = nvfp4.quantize_weight(w, G)
        assert torch.equal(q["weight_global_scale"], G.reshape(1))
    # a member with a smaller amax quantizes differently under the shared scale than under its own
    assert not torch.equal(nvfp4.quantize_weight(ws[0], G)["weight_scale"].float(),
                           nvfp4.quantize_weight(ws[0])["weight_scale"].float())
    # the largest member's block scales reach 448 exactly
    assert float(nvfp4.quantize_weight(ws[1], G)["weight_scale"].float().max()) == 448.0


# --------------------------------------------------------------------------------- compressed-tensors


def _ct_args():
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True,
                            dynamic=False, scale_dtype=torch.float8_e4m3fn)


def _ct_compress(w: torch.Tensor, gscale: torch.Tensor | None = None):
    """compressed-tensors' own global scale, block scales, codes and packing for ``w``."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    args = _ct_args()
    wf = w.float()
    if gscale is None:
        gscale = generate_gparam(wf.amin().reshape(1), wf.amax().reshape(1))
    n, k = w.shape
    blocks = wf.reshape(n, k // 16, 16)
    scale, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=gscale)
    qx = quantize(x=w, scale=scale.float(), zero_point=None, args=args, global_scale=gscale)
    return gscale, scale.to(torch.float8_e4m3fn), pack_fp4_to_uint8(qx)


def _weights(dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(48, 128, generator=g) * 0.05
    w[3, 16:32] = 0.0  # a zero block
    w[5, :16] = -1e-6 * torch.rand(16, generator=g)  # a block of tiny negatives (round to -0)
    w[7, 5] = -1e-7  # a tiny negative in an ordinary block
    w[9, 100] = 0.9  # an outlier that sets G
    w[11, 64:80] = torch.randn(16, generator=g) * 1e-4  # a block far below the rest
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bit_exact_against_compressed_tensors(dtype, seed):
    w = _weights(dtype, seed)
    ours = nvfp4.quantize_weight(w)
    g, s, packed = _ct_compress(w)
    assert torch.equal(ours["weight_global_scale"], g.float().reshape(1))
    assert torch.equal(ours["weight_scale"].view(torch.uint8), s.view(torch.uint8))
    assert torch.equal(ours["weight_packed"], packed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bit_exact_against_compressed_tensors_shared_scale(dtype):
    ws = [_weights(dtype, s) * f for s, f in ((3, 1.0), (4, 3.0))]
    G = nvfp4.fused_global_scale(ws)
    for w in ws:
        ours = nvfp4.quantize_weight(w, G)
        _, s, packed = _ct_compress(w, G)
        assert torch.equal(ours["weight_scale"].view(torch.uint8), s.view(torch.uint8))
        assert torch.equal(ours["weight_packed"], packed)


def test_test_vector_matches_compressed_tensors():
    w = torch.tensor([0.02 * i * (-1) ** i for i in range(32)]).to(torch.bfloat16).reshape(1, 32)
    g, s, packed = _ct_compress(w)
    assert bytes(packed[0].tolist()).hex() == "90a2c3d4d5e6f6f7d5e5e6e6e6f7f7f7"
    assert s.float().tolist() == [[224.0, 448.0]]
    assert float(g) == float(nvfp4.quantize_weight(w)["weight_global_scale"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_matches_compressed_tensors_decompress(dtype):
    from compressed_tensors.compressors.nvfp4 import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    w = _weights(dtype, 5)
    q = nvfp4.quantize_weight(w)
    scheme = QuantizationScheme(targets=["Linear"], weights=_ct_args())
    out = NVFP4PackedCompressor.decompress(dict(q), scheme)
    ours = nvfp4.dequantize(nvfp4.unpack_nibbles(q["weight_packed"]), q["weight_scale"],
                            q["weight_global_scale"], torch.bfloat16)
    assert out["weight"].dtype == torch.bfloat16
    assert torch.equal(out["weight"].view(torch.int16), ours.view(torch.int16))
    # and the fake-quantized values are what the checkpoint holds
    assert torch.equal(nvfp4.fake_quantize(w), nvfp4.dequantize(
        nvfp4.unpack_nibbles(q["weight_packed"]), q["weight_scale"], q["weight_global_scale"]))
