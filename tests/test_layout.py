"""The packed tile layout (src/qerl_cli/layout.py): round trips, hand-checked positions, padding, reference matmul,
and the kernel's decode header (csrc/nvfp4_decode.cuh, compiled for the host with nvcc) against the packer.

Positions are recomputed here from the module docstring's table, independently of layout.py's own tables:
lane L = 4g + t owns bytes [16L, 16L + 16) as four little-endian uint32 words (word j = sub-tile j); a word holds
a[p, h] (tile row g + 8 * (p % 2), sub-tile column 2t + h + 8 * (p // 2)) with its code bit b at the word bit the
docstring gives for p (T, T - 10, T - 13 mod 32, or 16h + (4, 0, 1, 3)[b]; T = 16h + (6, 7, 8, 15)[b]), so that
the kernel's four register formulas yield each register's two codes in bf16 bit positions. Scale byte
512 + 8g + 2j + r serves row g + 8r of sub-tile j.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from qerl_cli import layout, nvfp4

E4M3 = torch.float8_e4m3fn


def _docstring_code_address(row: int, col: int) -> tuple[int, int, int, int, int]:
    """(row tile, k tile, first byte of the word in the record, p, h) of weight (row, col), from the docstring."""
    nt, r = divmod(row, 16)
    kt, c = divmod(col, 64)
    j, cc = divmod(c, 16)
    g, prow = r % 8, r // 8  # p % 2
    pcol, rest = divmod(cc, 8)  # p // 2
    t, h = divmod(rest, 2)
    p = prow + 2 * pcol
    lane = 4 * g + t
    return nt, kt, 16 * lane + 4 * j, p, h


def _docstring_bit(p: int, h: int, b: int) -> int:
    """The word bit of code bit b (0 = m, 1 = e0, 2 = e1, 3 = sign) of element (p, h), from the docstring."""
    t = 16 * h + (6, 7, 8, 15)[b]
    return (t, (t - 10) % 32, (t - 13) % 32, 16 * h + (4, 0, 1, 3)[b])[p]


def _word(q: torch.Tensor, nt: int, kt: int, at: int) -> int:
    return int.from_bytes(bytes(q[nt, kt, at: at + 4].tolist()), "little")


def _docstring_code(q: torch.Tensor, row: int, col: int) -> int:
    nt, kt, at, p, h = _docstring_code_address(row, col)
    w = _word(q, nt, kt, at)
    return sum(((w >> _docstring_bit(p, h, b)) & 1) << b for b in range(4))


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
            assert _docstring_code(q, row, col) == int(codes[row, col]), (row, col)
        for grp in range(k // 16):
            nt, kt, b = _docstring_scale_address(row, grp)
            assert int(q[nt, kt, b]) == int(scales.view(torch.uint8)[row, grp]), (row, grp)


def test_hand_checked_positions():
    """A few positions worked out by hand from the docstring table."""
    n, k = 32, 128
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scales = torch.zeros(n, k // 16, dtype=torch.uint8)
    # (0, 0): lane 0, word 0, p = 0, h = 0: code 0x3 = m and e0 -> word bits 6, 7
    codes[0, 0] = 0x3
    # (0, 1): h = 1: code 0x5 = m and e1 -> word bits 22, 24
    codes[0, 1] = 0x5
    # (8, 0): p = 1, h = 0: code 0x9 = m and sign -> bits (6 - 10) mod 32 = 28 and 15 - 10 = 5
    codes[8, 0] = 0x9
    # (9, 47): g = 1, p = 3, t = 3, h = 1, j = 2 -> lane 7, word at byte 16 * 7 + 8 = 120; code 0xA = e0 and
    # sign -> bits 16 + 0 = 16 and 16 + 3 = 19
    codes[9, 47] = 0xA
    # (0, 10): sub-tile col 10 -> p = 2, t = 1, h = 0 -> lane 1, word at byte 16; code 0x6 = e0, e1 -> bits
    # (7 - 13) mod 32 = 26 and (8 - 13) mod 32 = 27
    codes[0, 10] = 0x6
    # (17, 64): second row tile, second k tile, local (1, 0): lane 4, word at byte 64; code 0xC = e1 and sign at
    # p = 0 -> bits 8 and 15
    codes[17, 64] = 0xC
    # scales: row 13 (g=5, r=1), group 3 -> byte 512 + 40 + 6 + 1 = 559; row 16 group 4 -> tile (1, 1) byte 512
    scales[13, 3] = 0x38
    scales[16, 4] = 0x40
    q = layout.pack(codes, scales.view(E4M3))
    bits = lambda *b: sum(1 << x for x in b)  # noqa: E731
    assert _word(q, 0, 0, 0) == bits(6, 7, 22, 24, 28, 5)
    assert _word(q, 0, 0, 120) == bits(16, 19)
    assert _word(q, 0, 0, 16) == bits(26, 27)
    assert _word(q, 1, 1, 64) == bits(8, 15)
    assert int(q[0, 0, 559]) == 0x38
    assert int(q[1, 1, 512]) == 0x40
    # nothing else is set
    assert int((q[..., :512] != 0).sum()) == 6 and int((q[..., 512:] != 0).sum()) == 2


def _rotl(w: int, r: int) -> int:
    return ((w << r) | (w >> (32 - r))) & 0xFFFFFFFF if r else w


def _bf16_pattern(lo: int, hi: int) -> int:
    """Two E2M1 codes as the kernel's bf16x2 register bits (value * 2^-126): sign at 15, e1 e0 m at 8..6."""
    one = lambda c: ((c & 8) << 12) | ((c & 7) << 6)  # noqa: E731
    return one(lo) | (one(hi) << 16)


def test_a_lanes_word_feeds_fragment_registers():
    """The kernel's four formulas turn a word into fragment registers p = 0..3 (low half = smaller column)."""
    mask = 0x81C081C0
    codes, scales = _random_case(16, 64, seed=3)
    q = layout.pack(codes, scales)
    for lane in (0, 5, 31):
        g, t = lane >> 2, lane & 3
        for j in range(4):
            w = _word(q, 0, 0, 16 * lane + 4 * j)
            regs = [w & mask, _rotl(w, 10) & mask, _rotl(w, 13) & mask,
                    (((w & 0x001B001B) * 0x1084) & 0xFFFFFFFF) & mask]
            for p in range(4):
                row = g + 8 * (p % 2)
                col = 16 * j + 2 * t + 8 * (p // 2)
                assert regs[p] == _bf16_pattern(int(codes[row, col]), int(codes[row, col + 1])), (lane, j, p)


def test_bf16_pattern_is_the_value():
    """value * 2^-126 in bf16 bits, for all 16 codes (the bit trick the register formulas rely on)."""
    values = nvfp4.e2m1_table(dtype=torch.float32)
    for c in range(16):
        v = torch.tensor([_bf16_pattern(c, 0) << 16], dtype=torch.int64).to(torch.int32).view(torch.float32).item()
        assert v * 2.0**126 == float(values[c]), c


@pytest.mark.parametrize("n,k", [(20, 48), (17, 80), (1, 16), (100, 144)])
def test_padding_is_zero(n, k):
    codes = torch.full((n, k), 0xF, dtype=torch.uint8)
    scales = torch.full((n, k // 16), 0x7E, dtype=torch.uint8).view(E4M3)
    q = layout.pack(codes, scales)
    np_, kp = layout.padded_shape(n, k)
    real = torch.zeros_like(q, dtype=torch.bool)
    for row in range(np_):
        for col in range(kp):
            assert _docstring_code(q, row, col) == (0xF if row < n and col < k else 0), (row, col)
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


# ------------------------------------------ the CUDA decode header, compiled for the host, against the packer
CSRC = Path(__file__).resolve().parents[1] / "csrc"

PROGRAM = r"""
#include <cstdio>
#include "nvfp4_decode.cuh"
int main() {
  unsigned w;
  while (std::scanf("%x", &w) == 1)
    std::printf("%08x %08x %08x %08x\n", qerl_decode::reg<0>(w), qerl_decode::reg<1>(w), qerl_decode::reg<2>(w),
                qerl_decode::reg_at(w, 3));
  return 0;
}
"""


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    d = tmp_path_factory.mktemp("decode")
    (d / "main.cu").write_text(PROGRAM)
    subprocess.run([nvcc, "-std=c++17", "-I", str(CSRC), "-o", str(d / "decode"), str(d / "main.cu")], check=True,
                   capture_output=True, timeout=300)
    return d / "decode"


def test_header_decodes_what_the_packer_writes(decoder):
    gen = torch.Generator().manual_seed(5)
    n, k = 32, 128
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)  # every code at least once
    scales = torch.ones(n, k // 16).to(torch.float8_e4m3fn)
    q = layout.pack(codes, scales)
    words, expect = [], []
    for nt in range(q.shape[0]):
        for kt in range(q.shape[1]):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for j in range(4):
                    at = 16 * lane + 4 * j
                    words.append(_word(q, nt, kt, at))
                    regs = []
                    for p in range(4):
                        row = 16 * nt + g + 8 * (p % 2)
                        col = 64 * kt + 16 * j + 2 * t + 8 * (p // 2)
                        regs.append(_bf16_pattern(int(codes[row, col]), int(codes[row, col + 1])))
                    expect.append(regs)
    out = subprocess.run([str(decoder)], input="\n".join(f"{w:08x}" for w in words), capture_output=True,
                         text=True, check=True, timeout=60).stdout.split("\n")
    got = [[int(v, 16) for v in line.split()] for line in out if line.strip()]
    assert len(got) == len(expect) == 2 * 2 * 32 * 4
    bad = [(i, [hex(v) for v in g], [hex(v) for v in e]) for i, (g, e) in enumerate(zip(got, expect)) if g != e]
    assert not bad, bad[:3]
