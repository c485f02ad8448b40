"""How the stream-K kernel's CTA count and rows per CTA set its small-M speed: a sweep over grid sizes that align
with row groups (every CTA inside one row group: no CTA crosses a row-group boundary mid-kernel) and the default.

    python benchmarks/probe_partition.py [--ms 1,8,16] [--json benchmarks/results/partition.json]

For each Qwen2.5-7B projection shape and M: the time per call of ``kernel.linear`` in a CUDA graph of back-to-back
launches on rotating weight copies (as bench_kernel.py times them) for the automatic choice, then the stream-K
kernel with 8 warps per CTA (128 rows per row group), with 4 (64 rows) and with 10 (160 rows, M <= 16) at grid sizes P = RG * s (RG row
groups, s splits of each row group's K range, up to MAXP CTAs) and at the default grid; cuBLAS bf16 beside them.
Every configuration's output is compared with the automatic one's (only the fp32 order of split sums differs).
Session 21's timeline probe (benchmarks/results/s21/) found the CTAs whose range crosses a row group end late
(their first segment's epilogue and the second's pipeline fill sit mid-kernel).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_kernel import random_packed, time_graph  # noqa: E402

from qerl_cli import kernel  # noqa: E402

SHAPES_7B = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
VARIANTS = {"v2w8": (4, 128), "v2": (2, 64), "v2w10": (5, 160)}  # set_variant code, rows per row group


def cluster_ab(ext, ours, outs, name, m, t_cublas, result, calls) -> None:
    """auto with cluster sums off / on, interleaved three times; the outputs must be equal bit for bit."""
    ext.set_variant(3)
    ts = {False: [], True: []}
    got, used = {}, {}
    try:
        for _ in range(3):
            for on in (False, True):
                ext.set_v2_cluster(on)
                ts[on].append(time_graph(ours, calls, calls))
                got[on], used[on] = outs[0].clone(), int(ext.last_v2_cluster())
    finally:
        ext.set_v2_cluster(True)
    same = bool(torch.equal(got[False], got[True]))
    off, on = sorted(ts[False])[1] * 1e6, sorted(ts[True])[1] * 1e6
    result["rows"].append({"shape": name, "m": m, "workspace_us": off, "cluster_us": on, "cluster_size": used[True],
                           "grid": int(ext.last_v2_grid()), "bit_identical": same, "cublas_us": t_cublas * 1e6})
    print(f"{name:8s} M={m:<3d} cuBLAS {t_cublas * 1e6:6.1f} | workspace {off:6.1f} cluster({used[True]}) {on:6.1f} "
          f"({off / on:.3f}x) bit-identical {same}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,8,16")
    ap.add_argument("--calls", type=int, default=12)
    ap.add_argument("--maxp", type=int, default=800)
    ap.add_argument("--shapes", default=",".join(SHAPES_7B), help="of " + ",".join(SHAPES_7B))
    ap.add_argument("--variants", default="v2w8,v2", help="of " + ",".join(VARIANTS))
    ap.add_argument("--cluster-ab", action="store_true",
                    help="instead of the sweep: auto with the aligned grids' split-K sums through thread-block "
                         "clusters (set_v2_cluster) against the workspace, interleaved, outputs compared bit for bit")
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "partition.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_partition: needs a CUDA device", file=sys.stderr)
        return 2
    ext = kernel._load()
    if ext is None or not hasattr(ext, "set_v2_grid"):
        print(f"probe_partition: the kernel extension is unavailable: {kernel.build_error()}", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "rows": []}
    try:
        for name in args.shapes.split(","):
            n, k = SHAPES_7B[name]
            qws = [random_packed(n, k, gen) for _ in range(args.calls)]
            wbf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4)]
            gs = torch.tensor([2000.0], device="cuda")
            for m in [int(v) for v in args.ms.split(",")]:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                outs = [torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for _ in range(args.calls)]

                def ours(i):
                    ext.linear_out(x, qws[i], gs, n, k, outs[i], 0)

                def cublas(i):
                    torch.matmul(x, wbf[i % len(wbf)].t())

                t_cublas = time_graph(cublas, len(wbf), args.calls)
                if args.cluster_ab:
                    cluster_ab(ext, ours, outs, name, m, t_cublas, result, args.calls)
                    continue
                ext.set_variant(3)
                t_auto = time_graph(ours, args.calls, args.calls)
                ref = outs[0].float().clone()
                best = (t_auto, "auto", 0)
                line = [f"auto {t_auto * 1e6:6.1f}"]
                for vname in args.variants.split(","):
                    code, rows = VARIANTS[vname]
                    rg = -(-n // rows)
                    grids = [0] + [rg * s for s in range(1, args.maxp // rg + 1)]
                    for p in grids:
                        ext.set_variant(code)
                        ext.set_v2_grid(p)
                        try:
                            t = time_graph(ours, args.calls, args.calls)
                        finally:
                            ext.set_v2_grid(0)
                            ext.set_variant(3)
                        err = float(((outs[0].float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)))
                        result["rows"].append({"shape": name, "m": m, "variant": vname, "grid": p, "us": t * 1e6,
                                               "auto_us": t_auto * 1e6, "cublas_us": t_cublas * 1e6,
                                               "rel_diff_vs_auto": err})
                        if t < best[0]:
                            best = (t, vname, p)
                        line.append(f"{vname}/{p or 'dflt'} {t * 1e6:5.1f}")
                print(f"{name:8s} M={m:<3d} cuBLAS {t_cublas * 1e6:6.1f} | " + " ".join(line), flush=True)
                print(f"{'':8s} best {best[1]}/{best[2] or 'dflt'} {best[0] * 1e6:.1f} us ({t_cublas / best[0]:.2f}x "
                      f"cuBLAS; auto {t_cublas / t_auto:.2f}x)", flush=True)
            del qws, wbf
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
