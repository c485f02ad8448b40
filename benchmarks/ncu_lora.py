"""The two LoRA kernels alone (fused.lora_add, no base launch) on the Qwen2.5-7B groups at M = 8, rank 32 per
member, twice each, for Nsight Compute to time every launch serialized (session 8: `ncu_lora_s8b_h200.txt`):

    ncu --clock-control none --kernel-name regex:lora --launch-count 12 --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats python3 benchmarks/ncu_lora.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from qerl_cli import fused  # noqa: E402

GROUPS = (("qkv", 3584, (3584, 512, 512)), ("gate_up", 3584, (18944, 18944)), ("down", 18944, (3584,)))


def main(m: int = 8, rank: int = 32) -> int:
    if not (torch.cuda.is_available() and fused.available()):
        print(f"ncu_lora: needs CUDA and the fused kernels ({fused.build_error()})", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    for name, k, sizes in GROUPS:
        r, n = rank * len(sizes), sum(sizes)
        x, a, y = rand(m, k), rand(r, k, scale=0.05), rand(m, n)
        bs = torch.zeros(r, n, dtype=torch.bfloat16, device="cuda")
        segs, col = [], 0
        for j, size in enumerate(sizes):  # block-diagonal, as the engine's batched terms
            bs[rank * j: rank * (j + 1), col: col + size] = rand(rank, size, scale=0.05)
            col += size
            segs += [col, rank * j, rank * (j + 1)]
        for _ in range(2):
            out = fused.lora_add(y, x, a, bs, tuple(segs))
        torch.cuda.synchronize()
        print(f"{name}: launched ({'kernels' if out is not None else 'declined'})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
