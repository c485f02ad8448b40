"""NVFP4 weight quantization: pure math, no I/O.

The on-disk format is compressed-tensors' ``nvfp4-pack-quantized`` (DESIGN §3):

* a tensor scale ``G = 448 * 6 / amax|W|`` (fp32), shared by a fused set of projections;
* one e4m3 block scale per 16 consecutive input columns, ``s = e4m3(min(G * amax_block / 6, 448))``,
  with 0 replaced by 0.125;
* E2M1 codes ``round_to_nearest_even(clamp(W / (s / G), -6, 6))`` with the sign in bit 3;
* dequantization ``w = E2M1(code) * float(s) / G`` — ``G`` is a divisor.

Everything here works on any device and in fp32; results are bit-exact against compressed-tensors 0.19
(checked in ``tests/test_nvfp4.py``).
"""

from __future__ import annotations

import torch

from .errors import QerlError

GROUP_SIZE = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
ZERO_SCALE_REPLACEMENT = 0.125

# Magnitudes of the 8 non-negative E2M1 codes (index = low 3 bits of a code).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Decision thresholds between neighbouring magnitudes and whether a tie rounds up (to the even code).
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_table(device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Value of each of the 16 E2M1 codes (bit 3 is the sign)."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=dtype, device=device)
    return torch.cat([mags, -mags])


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value (ties to even), clamping to ±6, and return uint8 codes 0..15."""
    x = x.float()
    mag = x.abs().clamp(max=E2M1_MAX)
    idx = torch.zeros_like(mag, dtype=torch.uint8)
    for t, tie_up in _THRESHOLDS:
        up = (mag >= t) if tie_up else (mag > t)
        idx += up.to(torch.uint8)
    # Negative values keep their sign bit even when they round to zero (code 8), as compressed-tensors
    # packs them (an input of -0.0 is not negative: code 0); dequantized values are equal either way.
    return idx | ((x < 0).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of uint8 codes 0..15."""
    return e2m1_table(codes.device, dtype)[codes.long()]


def global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """fp32 tensor scale ``448 * 6 / amax`` as a shape-[1] tensor (amax of a whole fused set)."""
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    amax = amax.clamp(min=torch.finfo(torch.float32).tiny)
    # an all-zero (or denormal-amax) weight would overflow: 1.0 instead, as compressed-tensors does
    return torch.nan_to_num((E4M3_MAX * E2M1_MAX) / amax, nan=1.0, posinf=1.0, neginf=1.0)


def block_amax(weight: torch.Tensor) -> torch.Tensor:
    """amax over each group of 16 input columns: ``[N, K] -> [N, K/16]`` fp32."""
    n, k = weight.shape
    if k % GROUP_SIZE:
        raise ValueError(f"input dimension {k} is not a multiple of {GROUP_SIZE}")
    return weight.float().abs().reshape(n, k // GROUP_SIZE, GROUP_SIZE).amax(dim=-1)


def block_scales(weight: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """e4m3 block scales ``[N, K/16]`` (float8_e4m3fn) for one weight under tensor scale ``gscale``."""
    s = (gscale.float() * (block_amax(weight) / E2M1_MAX)).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    zero = s.float() == 0
    if zero.any():
        # in fp32 (exact: both values are e4m3 numbers), on the scales' own device
        s = torch.where(zero, torch.full_like(s, ZERO_SCALE_REPLACEMENT, dtype=torch.float32), s.float())
        s = s.to(torch.float8_e4m3fn)
    return s


def quantize_codes(weight: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor) -> torch.Tensor:
    """E2M1 codes ``[N, K]`` uint8 of ``weight`` under given block scales and tensor scale."""
    n, k = weight.shape
    step = scales.float() / gscale.float()  # [N, K/16]
    x = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE) / step.unsqueeze(-1)
    return e2m1_encode(x.clamp(-E2M1_MAX, E2M1_MAX)).reshape(n, k)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, gscale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``E2M1(code) * float(s) / G`` in fp32, cast to ``dtype``: ``[N, K]``."""
    n, k = codes.shape
    vals = e2m1_decode(codes).reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    w = vals * (scales.float() / gscale.float()).unsqueeze(-1)
    return w.reshape(n, k).to(dtype)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` codes -> ``[N, K/2]`` uint8, column 2j in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[N, K/2]`` uint8 -> ``[N, K]`` codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def quantize_weight(weight: torch.Tensor, gscale: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Quantize one ``[N, K]`` weight. Returns compressed-tensors' ``weight_packed``, ``weight_scale``,
    ``weight_global_scale``. Pass ``gscale`` to share one tensor scale across a fused set."""
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("weight holds NaN or infinite values")
    if gscale is None:
        gscale = global_scale(weight.float().abs().amax())
    scales = block_scales(weight, gscale)
    codes = quantize_codes(weight, scales, gscale)
    return {"weight_packed": pack_nibbles(codes), "weight_scale": scales,
            "weight_global_scale": gscale.float().reshape(1).clone()}


def fake_quantize(weight: torch.Tensor, gscale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize then dequantize (fp32 result), exactly the values the checkpoint will hold."""
    if gscale is None:
        gscale = global_scale(weight.float().abs().amax())
    scales = block_scales(weight, gscale)
    return dequantize(quantize_codes(weight, scales, gscale), scales, gscale)


def fused_global_scale(weights: list[torch.Tensor]) -> torch.Tensor:
    """One tensor scale for a fused set (q/k/v or gate/up): from the amax over all members."""
    amax = torch.stack([w.float().abs().amax() for w in weights]).amax()
    return global_scale(amax)


def check_in_features(name: str, k: int) -> None:
    """One sentence (QerlError) where the linear ``name`` with ``k`` input features cannot be NVFP4 (groups of 16)."""
    if k % GROUP_SIZE:
        raise QerlError(f"{name} has {k} input features, not a multiple of {GROUP_SIZE}; NVFP4 cannot hold it.")
