"""The packed tile layout (src/qerl_cli/layout.py): round trips, hand-checked positions, padding, reference matmul.

Positions are recomputed here from the module docstring's table, independently of layout.py's own tables:
lane L = 4g + t owns bytes [16L, 16L + 16) as four little-endian uint32 words (word j = sub-tile j); nibble i of
a word (bits 4i..4i+3, so byte i // 2 of the word, high half when i is odd) holds a[p, h], p = i % 4, h = i // 4,
at tile row g + 8 * (p % 2) and sub-tile column 2t + h + 8 * (p // 2). Scale byte 512 + 8g + 2j + r serves row
g + 8r of sub-tile j.
"""

from __future__ import annotations

import pytest
import torch

from qerl_cli import layout, nvfp4

E4M3 = torch.float8_e4m3fn


def _docstring_code_address(row: int, col: int) -> tuple[int, int, int, bool]:
    """(row tile, k tile, byte in the record, high nibble?) of weight (row, col), from the docstring table."""
    nt, r = divmod(row, 16)
    kt, c = divmod(col, 64)
    j, cc = divmod(c, 16)
    g, prow = r % 8, r // 8  # p % 2
    pcol, rest = divmod(cc, 8)  # p // 2
    t, h = divmod(rest, 2)
    p = prow + 2 * pcol
    i = p + 4 * h
    lane = 4 * g + t
    byte = 16 * lane + 4 * j + i // 2
    return nt, kt, byte, bool(i % 2)


def _docstring_scale_address(row: int, group: int) -> tuple[int, int, int]:
    nt, r = divmod(row, 16)
    kt, j = divmod(group, 4)
    g, rr = r % 8, r // 8
    return nt, kt, 512 + 8 * g + 2 * j + rr


def _random_case(n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    # any finite positive e4m3 value (bytes 0x01..0x7e), so scales are all distinct-ish and nonzero
    scales = torch.randint(1, 0x7F, (n, k // 16), generator=gen, dtype=torch.uint8).view(E4M3)
    return codes, scales


SHAPES = [(16, 64), (32, 128), (16, 16), (16, 48), (20, 64), (1, 16), (17, 80), (48, 192), (100, 144), (576, 192),
          (192, 576)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_round_trip(n, k):
    codes, scales = _random_case(n, k, seed=n * 1000 + k)
    q = layout.pack(codes, scales)
    np_, kp = layout.padded_shape(n, k)
    assert np_ % 16 == 0 and kp % 64 == 0 and np_ - n < 16 and kp - k < 64
    assert q.dtype == torch.uint8 and tuple(q.shape) == (np_ // 16, kp // 64, 576)
    c2, s2 = layout.unpack(q, n, k)
    assert torch.equal(c2, codes)
    assert s2.dtype == E4M3 and torch.equal(s2.view(torch.uint8), scales.view(torch.uint8))


def test_padded_shape():
    assert layout.padded_shape(16, 64) == (16, 64)
    assert layout.padded_shape(17, 80) == (32, 128)
    assert layout.padded_shape(1, 16) == (16, 64)
    assert layout.RECORD_BYTES == 576 == layout.CODE_BYTES + layout.SCALE_BYTES


@pytest.mark.parametrize("n,k", [(16, 64), (20, 48), (33, 144), (48, 128)])
def test_every_position_matches_docstring(n, k):
    codes, scales = _random_case(n, k, seed=7)
    q = layout.pack(codes, scales)
    for row in range(n):
        for col in range(k):
            nt, kt, b, high = _docstring_code_address(row, col)
            byte = int(q[nt, kt, b])
            assert (byte >> 4 if high else byte & 0xF) == int(codes[row, col]), (row, col)
        for grp in range(k // 16):
            nt, kt, b = _docstring_scale_address(row, grp)
            assert int(q[nt, kt, b]) == int(scales.view(torch.uint8)[row, grp]), (row, grp)


def test_hand_checked_positions():
    """A few positions worked out by hand from the docstring table."""
    n, k = 32, 128
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, k // 16, dtype=torch.uint8)
    # (0, 0): lane 0, word 0, nibble 0 -> byte 0, low nibble
    codes[0, 0] = 0x3
    # (0, 1): h = 1 -> nibble 4 -> byte 2, low nibble
    codes[0, 1] = 0x5
    # (8, 0): p = 1 -> nibble 1 -> byte 0, high nibble
    codes[8, 0] = 0x9
    # (9, 47): g=1, p=3, t=3, h=1, j=2 -> lane 7, nibble 7 -> byte 16*7 + 4*2 + 3 = 123, high nibble
    codes[9, 47] = 0xA
    # (0, 10): sub-tile col 10 -> p//2 = 1, t = 1, h = 0 -> p = 2, i = 2, lane 1 -> byte 16 + 1 = 17, low nibble
    codes[0, 10] = 0x6
    # (17, 64): second row tile, second k tile, local (1, 0): lane 4 -> byte 64, low nibble
    codes[17, 64] = 0xC
    # scales: row 13 (g=5, r=1), group 3 -> byte 512 + 40 + 6 + 1 = 559; row 16 group 4 -> tile (1, 1) byte 512
    scales[13, 3] = 0x38
    scales[16, 4] = 0x40
    q = layout.pack(codes, scales.view(E4M3))
    assert int(q[0, 0, 0]) == 0x93
    assert int(q[0, 0, 2]) == 0x05
    assert int(q[0, 0, 123]) == 0xA0
    assert int(q[0, 0, 17]) == 0x06
    assert int(q[1, 1, 64]) == 0x0C
    assert int(q[0, 0, 559]) == 0x38
    assert int(q[1, 1, 512]) == 0x40
    # nothing else is set
    assert int((q != 0).sum()) == 7


def test_a_lanes_word_feeds_fragment_registers():
    """``(word >> 4p) & 0x000F000F`` yields register p's two elements (low half = smaller column)."""
    codes, scales = _random_case(16, 64, seed=3)
    q = layout.pack(codes, scales)
    for lane in (0, 5, 31):
        g, t = lane >> 2, lane & 3
        for j in range(4):
            word = int.from_bytes(bytes(q[0, 0, 16 * lane + 4 * j: 16 * lane + 4 * j + 4].tolist()), "little")
            for p in range(4):
                reg = (word >> (4 * p)) & 0x000F000F
                row = g + 8 * (p % 2)
                col = 16 * j + 2 * t + 8 * (p // 2)
                assert reg & 0xF == int(codes[row, col])
                assert reg >> 16 == int(codes[row, col + 1])


@pytest.mark.parametrize("n,k", [(20, 48), (17, 80), (1, 16), (100, 144)])
def test_padding_is_zero(n, k):
    codes = torch.full((n, k), 0xF, dtype=torch.uint8)
    scales = torch.full((n, k // 16), 0x7E, dtype=torch.uint8).view(E4M3)
    q = layout.pack(codes, scales)
    np_, kp = layout.padded_shape(n, k)
    real = torch.zeros_like(q, dtype=torch.bool)
    for row in range(np_):
        for col in range(kp):
            nt, kt, b, high = _docstring_code_address(row, col)
            byte = int(q[nt, kt, b])
            nib = byte >> 4 if high else byte & 0xF
            assert nib == (0xF if row < n and col < k else 0), (row, col)
        for grp in range(kp // 16):
            nt, kt, b = _docstring_scale_address(row, grp)
            assert int(q[nt, kt, b]) == (0x7E if row < n and grp < k // 16 else 0), (row, grp)
            real[nt, kt, b] = True
    # every byte of every record is accounted for by the docstring's addressing
    assert int(real[..., 512:].sum()) == q[..., 512:].numel()


@pytest.mark.parametrize("n,k", [(16, 64), (20, 48), (96, 128), (33, 208)])
@pytest.mark.parametrize("m", [1, 7, 64])
def test_reference_matmul_equals_dense(n, k, m):
    gen = torch.Generator().manual_seed(n + k + m)
    w = torch.randn(n, k, generator=gen) * 0.1
    qd = nvfp4.quantize_weight(w)
    codes = nvfp4.unpack_nibbles(qd["weight_packed"])
    dense = nvfp4.dequantize(codes, qd["weight_scale"], qd["weight_global_scale"])
    q = layout.pack(codes, qd["weight_scale"])
    assert torch.equal(layout.dequantize(q, qd["weight_global_scale"], n, k), dense)
    x = torch.randn(m, k, generator=gen)
    y = layout.reference_matmul(x, q, qd["weight_global_scale"], n, k)
    assert y.shape == (m, n) and y.dtype == torch.float32
    torch.testing.assert_close(y, x @ dense.t(), rtol=1e-6, atol=1e-6)
    # and close to the unquantized product (NVFP4 error, not a layout error)
    assert float((y - x @ w.t()).norm() / (x @ w.t()).norm()) < 0.15
    yb = layout.reference_matmul(x.bfloat16(), q, qd["weight_global_scale"], n, k)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.float(), (x.bfloat16().float() @ dense.t()), rtol=1e-2, atol=1e-2)


def test_pack_rejects_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 16"):
        layout.pack(torch.zeros(16, 24, dtype=torch.uint8), torch.zeros(16, 1, dtype=torch.uint8).view(E4M3))
    with pytest.raises(ValueError, match="do not match"):
        layout.pack(torch.zeros(16, 32, dtype=torch.uint8), torch.zeros(16, 3, dtype=torch.uint8).view(E4M3))
    q = layout.pack(*_random_case(16, 64))
    with pytest.raises(ValueError):
        layout.unpack(q, 32, 64)
    with pytest.raises(ValueError):
        layout.unpack(q[..., :512], 16, 64)
