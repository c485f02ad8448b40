"""The packed NVFP4 layout that our CUDA kernel reads — the only module that knows it.

A quantized Linear with ``N`` outputs and ``K`` inputs (codes ``[N, K]``, e4m3 scales ``[N, K/16]``, fp32
tensor scale ``G``, as in the compressed-tensors checkpoint) becomes

* ``qweight``: uint8 ``[N_pad/16, K_pad/64, 576]`` — one 576-byte **tile record** per 16 output rows × 64
  inputs, rows padded to a multiple of 16 and inputs to a multiple of 64 with zero codes and zero scales
  (so padding contributes exactly 0). Records of one row block are contiguous along K: a warp streams
  them with 16-byte loads.
* ``global_scale``: fp32 ``[1]``, the checkpoint's ``G`` (a divisor, as on disk).

The kernel computes ``out^T = W · x^T`` with the weight tile as the **A operand** of
``mma.sync.m16n8k16`` (rows = output features, columns = inputs) and the activations as the B operand
(tokens as its 8 columns), so one warp-wide 16-byte load per lane feeds four MMAs without shuffles:

``bytes [0, 512)`` — codes. Lane ``L`` (``g = L >> 2``, ``t = L & 3``) owns bytes ``[16L, 16L + 16)``:
four little-endian uint32 words, word ``j`` for the 16-input sub-tile ``j`` (inputs ``64·kt + 16j …``).
Nibble ``i`` of a word (bits ``4i…4i+3``) holds the A-fragment element ``a[p, h]`` with ``p = i % 4`` and
``h = i // 4``:

======  =================  ======================
``p``   row in the tile     column in the sub-tile
======  =================  ======================
0       ``g``               ``2t + h``
1       ``g + 8``           ``2t + h``
2       ``g``               ``2t + 8 + h``
3       ``g + 8``           ``2t + 8 + h``
======  =================  ======================

so ``(word >> 4p) & 0x000F000F`` puts the two elements of fragment register ``p`` in the low and high
16-bit halves (low = smaller column), ready for the E2M1 → bf16 bit trick.

``bytes [512, 576)`` — the e4m3 block scales of the tile: byte ``512 + 8g + 2j + r`` is the scale of row
``g + 8r`` for sub-tile ``j`` (one 16-input group). A lane reads its 8 scale bytes with one 8-byte load
(the four lanes of a row group read the same address: a broadcast).

``unpack`` inverts ``pack`` exactly; ``reference_matmul`` is the pure-torch product every other path is
checked against.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import nvfp4

TILE_N = 16
TILE_K = 64
CODE_BYTES = 512
SCALE_BYTES = 64
RECORD_BYTES = CODE_BYTES + SCALE_BYTES
LAYOUT_NAME = "qerl-nvfp4-tile16x64-v1"


def padded_shape(n: int, k: int) -> tuple[int, int]:
    return -(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K


@lru_cache(maxsize=None)
def _code_positions() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) inside a 16×64 tile for each of the 1024 nibbles, in storage order (lane, word, nibble)."""
    rows, cols = [], []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(4):
            for i in range(8):
                p, h = i % 4, i // 4
                rows.append(g + 8 * (p % 2))
                cols.append(16 * j + 2 * t + h + 8 * (p // 2))
    return torch.tensor(rows), torch.tensor(cols)


@lru_cache(maxsize=None)
def _scale_positions() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, group) inside a tile for each of the 64 scale bytes, in storage order (g, j, r)."""
    rows, groups = [], []
    for g in range(8):
        for j in range(4):
            for r in range(2):
                rows.append(g + 8 * r)
                groups.append(j)
    return torch.tensor(rows), torch.tensor(groups)


def pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes uint8 ``[N, K]`` (0..15) and e4m3 scales ``[N, K/16]`` → ``qweight`` ``[N_pad/16, K_pad/64, 576]``."""
    n, k = codes.shape
    if k % nvfp4.GROUP_SIZE:
        raise ValueError(f"input dimension {k} is not a multiple of {nvfp4.GROUP_SIZE}")
    if tuple(scales.shape) != (n, k // nvfp4.GROUP_SIZE):
        raise ValueError(f"scales of shape {tuple(scales.shape)} do not match codes of shape {(n, k)}")
    np_, kp = padded_shape(n, k)
    nt, kt = np_ // TILE_N, kp // TILE_K
    c = torch.zeros(np_, kp, dtype=torch.uint8, device=codes.device)
    c[:n, :k] = codes.to(torch.uint8)
    s = torch.zeros(np_, kp // nvfp4.GROUP_SIZE, dtype=torch.uint8, device=codes.device)
    s[:n, : k // nvfp4.GROUP_SIZE] = scales.view(torch.uint8)
    # tiles: [nt, kt, 16, 64]
    tiles = c.reshape(nt, TILE_N, kt, TILE_K).permute(0, 2, 1, 3)
    r, col = _code_positions()
    nib = tiles[:, :, r.to(c.device), col.to(c.device)]  # [nt, kt, 1024]
    code_bytes = nib[..., 0::2] | (nib[..., 1::2] << 4)  # [nt, kt, 512]
    stiles = s.reshape(nt, TILE_N, kt, 4).permute(0, 2, 1, 3)  # [nt, kt, 16, 4]
    sr, sg = _scale_positions()
    scale_bytes = stiles[:, :, sr.to(c.device), sg.to(c.device)]  # [nt, kt, 64]
    return torch.cat([code_bytes, scale_bytes], dim=-1).contiguous()


def unpack(qweight: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: ``(codes [N, K] uint8, scales [N, K/16] float8_e4m3fn)``."""
    nt, kt, rec = qweight.shape
    if rec != RECORD_BYTES or padded_shape(n, k) != (nt * TILE_N, kt * TILE_K):
        raise ValueError(f"packed weight of shape {tuple(qweight.shape)} does not hold a [{n}, {k}] matrix")
    cb = qweight[..., :CODE_BYTES]
    nib = torch.stack([cb & 0x0F, cb >> 4], dim=-1).reshape(nt, kt, 2 * CODE_BYTES)
    tiles = torch.empty(nt, kt, TILE_N, TILE_K, dtype=torch.uint8, device=qweight.device)
    r, col = _code_positions()
    tiles[:, :, r.to(qweight.device), col.to(qweight.device)] = nib
    codes = tiles.permute(0, 2, 1, 3).reshape(nt * TILE_N, kt * TILE_K)[:n, :k]
    stiles = torch.empty(nt, kt, TILE_N, 4, dtype=torch.uint8, device=qweight.device)
    sr, sg = _scale_positions()
    stiles[:, :, sr.to(qweight.device), sg.to(qweight.device)] = qweight[..., CODE_BYTES:]
    scales = stiles.permute(0, 2, 1, 3).reshape(nt * TILE_N, kt * 4)[:n, : k // nvfp4.GROUP_SIZE]
    return codes.contiguous(), scales.contiguous().view(torch.float8_e4m3fn)


def dequantize(qweight: torch.Tensor, gscale: torch.Tensor, n: int, k: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Dense ``[N, K]`` weight from the packed layout (pure torch)."""
    codes, scales = unpack(qweight, n, k)
    return nvfp4.dequantize(codes, scales, gscale, dtype)


def reference_matmul(x: torch.Tensor, qweight: torch.Tensor, gscale: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """``x @ W^T`` in fp32 with ``W`` dequantized from the packed layout; result in ``x.dtype``."""
    w = dequantize(qweight, gscale, n, k, torch.float32)
    return (x.float() @ w.t()).to(x.dtype)
