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
A word holds the eight A-fragment elements ``a[p, h]`` (``p`` = fragment register 0..3, ``h`` = its low or
high half) of this lane:

======  =================  ======================
``p``   row in the tile     column in the sub-tile
======  =================  ======================
0       ``g``               ``2t + h``
1       ``g + 8``           ``2t + h``
2       ``g``               ``2t + 8 + h``
3       ``g + 8``           ``2t + 8 + h``
======  =================  ======================

Their bits are scattered so that the kernel makes each bf16×2 register (``value · 2^-126``: sign at bit
``15 + 16h``, e1 e0 m at bits ``8..6 + 16h``, mask ``0x81C081C0``) in one to three instructions
(``benchmarks/decode_layout_search.py`` found the placement by exhaustive search):

* ``p = 0``: ``w & 0x81C081C0`` — code bit ``b`` (0 = m, 1 = e0, 2 = e1, 3 = sign) of half ``h`` sits at word
  bit ``T(h, b) = 16h + (6, 7, 8, 15)[b]``;
* ``p = 1``: ``rotl(w, 10) & 0x81C081C0`` — at bit ``(T(h, b) - 10) mod 32``;
* ``p = 2``: ``rotl(w, 13) & 0x81C081C0`` — at bit ``(T(h, b) - 13) mod 32``;
* ``p = 3``: ``((w & 0x001B001B) · 0x1084) & 0x81C081C0`` — at bits ``16h + (4, 0, 1, 3)[b]`` (the three
  shifted copies, by 2, 7 and 12, never overlap, so the product has no carries).

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
LAYOUT_NAME = "qerl-nvfp4-tile16x64-v2"  # v2 (session 5): the bit placement above; v1 held element (p, h) in nibble p + 4h


def padded_shape(n: int, k: int) -> tuple[int, int]:
    return -(-n // TILE_N) * TILE_N, -(-k // TILE_K) * TILE_K


@lru_cache(maxsize=None)
def _code_positions() -> tuple[torch.Tensor, torch.Tensor]:
    """(row, col) inside a 16×64 tile of each of the 1024 codes, in order (lane, word, element e = p + 4h)."""
    rows, cols = [], []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for j in range(4):
            for i in range(8):
                p, h = i % 4, i // 4
                rows.append(g + 8 * (p % 2))
                cols.append(16 * j + 2 * t + h + 8 * (p // 2))
    return torch.tensor(rows), torch.tensor(cols)


def _target_bit(h: int, b: int) -> int:
    return 16 * h + (6, 7, 8, 15)[b]


@lru_cache(maxsize=None)
def word_bit_positions() -> tuple[tuple[int, ...], ...]:
    """``[e][b]``: the word bit holding code bit ``b`` of element ``e = p + 4h`` (the table in the docstring)."""
    pos = []
    for e in range(8):
        p, h = e % 4, e // 4
        row = []
        for b in range(4):
            t = _target_bit(h, b)
            row.append(t if p == 0 else (t - 10) % 32 if p == 1 else (t - 13) % 32 if p == 2
                       else 16 * h + (4, 0, 1, 3)[b])
        pos.append(tuple(row))
    assert sorted(q for r in pos for q in r) == list(range(32))  # a permutation of the word's bits
    return tuple(pos)


@lru_cache(maxsize=None)
def _spread_table() -> torch.Tensor:
    """int64 ``[8, 16]``: code ``c`` of element ``e`` with its bits moved to their word positions."""
    return torch.tensor([[sum(((c >> b) & 1) << q for b, q in enumerate(row)) for c in range(16)]
                         for row in word_bit_positions()], dtype=torch.int64)


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
    nib = tiles[:, :, r.to(c.device), col.to(c.device)].reshape(nt, kt, 128, 8).to(torch.int64)  # 8 per word
    spread = _spread_table().to(c.device)  # [8, 16]: element e's code as its bits in the word
    words = torch.zeros(nt, kt, 128, dtype=torch.int64, device=c.device)
    for e in range(8):
        words |= spread[e][nib[..., e]]
    shifts = torch.arange(0, 32, 8, device=c.device)
    code_bytes = ((words[..., None] >> shifts) & 0xFF).to(torch.uint8).reshape(nt, kt, CODE_BYTES)  # little-endian
    stiles = s.reshape(nt, TILE_N, kt, 4).permute(0, 2, 1, 3)  # [nt, kt, 16, 4]
    sr, sg = _scale_positions()
    scale_bytes = stiles[:, :, sr.to(c.device), sg.to(c.device)]  # [nt, kt, 64]
    return torch.cat([code_bytes, scale_bytes], dim=-1).contiguous()


def unpack(qweight: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`pack`: ``(codes [N, K] uint8, scales [N, K/16] float8_e4m3fn)``."""
    nt, kt, rec = qweight.shape
    if rec != RECORD_BYTES or padded_shape(n, k) != (nt * TILE_N, kt * TILE_K):
        raise ValueError(f"packed weight of shape {tuple(qweight.shape)} does not hold a [{n}, {k}] matrix")
    cb = qweight[..., :CODE_BYTES].reshape(nt, kt, 128, 4).to(torch.int64)
    words = cb[..., 0] | (cb[..., 1] << 8) | (cb[..., 2] << 16) | (cb[..., 3] << 24)
    nib = torch.zeros(nt, kt, 128, 8, dtype=torch.int64, device=qweight.device)
    for e, row in enumerate(word_bit_positions()):
        for b, q in enumerate(row):
            nib[..., e] |= ((words >> q) & 1) << b
    nib = nib.to(torch.uint8).reshape(nt, kt, 2 * CODE_BYTES)
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
