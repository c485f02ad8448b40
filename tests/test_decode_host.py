"""csrc/nvfp4_decode.cuh — the kernel's E2M1 -> bf16x2 register formulas — run on the CPU against the Python
packer: the CUDA header is compiled for the host with nvcc (skipped where nvcc is absent), fed the words that
``layout.pack`` writes, and each register must hold the two codes' bf16 bit patterns (value * 2^-126)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from qerl_cli import layout

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


def _bf16_pattern(lo: int, hi: int) -> int:
    one = lambda c: ((c & 8) << 12) | ((c & 7) << 6)  # noqa: E731
    return one(lo) | (one(hi) << 16)


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
                    words.append(int.from_bytes(bytes(q[nt, kt, at: at + 4].tolist()), "little"))
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
