"""Small-M kernel variants of this build, one shape and M at a time, for Nsight Compute (each launch profiled
serialized; the kernel's template arguments in its name tell the variants apart, the printed markers the order):

    ncu --clock-control none --kernel-name regex:nvfp4_mma --section SpeedOfLight --section WarpStateStats \
        --section Occupancy --section MemoryWorkloadAnalysis_Tables \
        python3 benchmarks/ncu_variants.py --m 64 --variants default,alt

Variants ``tc1`` ... ``tc7`` are the tiled tensor-core kernels (path 2) with that tile configuration forced
(``--kernel-name regex:nvfp4_tc`` for the mma.sync tiles 1-3, ``regex:nvfp4_wg`` for the wgmma tiles 4-7).

Shapes: Qwen2.5-7B gate/up (37888 x 3584) and down (3584 x 18944), random packed weights (no download).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from qerl_cli import kernel  # noqa: E402

SHAPES = {"gate_up": (37888, 3584), "down": (3584, 18944), "qkv": (4608, 3584), "o": (3584, 3584)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", type=int, default=64)
    ap.add_argument("--variants", default="default,alt")
    ap.add_argument("--shapes", default="gate_up,down")
    ap.add_argument("--launches", type=int, default=2, help="launches per variant and shape")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and kernel.available()):
        print(f"ncu_variants: needs CUDA and the kernel ({kernel.build_error()})", file=sys.stderr)
        return 2
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_kernel import random_packed

    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    ext = kernel._load()
    for shape in (s.strip() for s in args.shapes.split(",")):
        n, k = SHAPES[shape]
        qw = random_packed(n, k, torch.Generator(device="cuda").manual_seed(1))
        gs = torch.tensor([2000.0], device="cuda")
        x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)
        for v in names:
            tiled = v.startswith("tc")
            if tiled:
                ext.set_tc_cfg(int(v[2:]))
            else:
                ext.set_variant(kernel.VARIANTS[v])
            torch.cuda.synchronize()
            print(f"ncu_variants: {shape} n={n} k={k} m={args.m} variant {v}: {args.launches} launches", flush=True)
            for _ in range(args.launches):
                ext.linear_out(x, qw, gs, n, k, out, 2 if tiled else 0)
            torch.cuda.synchronize()
    ext.set_variant(3)
    ext.set_tc_cfg(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
