"""A/B of two builds of csrc/nvfp4_kernel.cu in one process: this tree's against another source (for example the
previous commit's), on the Qwen2.5 linear shapes, auto path and variant, CUDA-graph timings interleaved A, B, A, B
so that clock drift and the machine affect both alike.

    PYTHONPATH=src python benchmarks/ab_kernel.py --other DIR_WITH_nvfp4_kernel.cu [--ms 1,8,16,32] [--json f]

With ``--fixups`` instead of ``--other``, A is this build with the batched stream-K fixup of the v2 kernels and B
the same build with the serial one (``set_fixup(1)`` against ``set_fixup(2)``), on the shapes that run v2.

With ``--variants v2w8,v3,...`` instead, every named small-M variant of this build (and ``auto``) is forced in
turn, interleaved round by round, beside cuBLAS with bf16 weights (``torch.matmul``, rotated copies as well); the
first variant is the reference of the bit-identity column (``same``: equal bits, else the relative difference).

With ``--prefetch 0,16,32`` instead, the automatic path of this build runs with each rolling L2 prefetch distance
of the stream-K kernels (``kernel.set_v2_prefetch``, in K tiles) in turn, the same way; the first distance is the
reference of the bit-identity column.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel import L2_BYTES, MODELS, random_packed, shapes, time_graph  # noqa: E402
from qerl_cli import kernel, layout  # noqa: E402


def packed_weights(models: str, gen: torch.Generator):
    """(model, layer, n, k, packed bytes, copies) for every linear shape of the comma-separated models: enough
    random packed copies of the weight that rotating over them keeps L2 from serving repeats."""
    for model in models.split(","):
        for layer, n, k in shapes(model):
            np_, kp = layout.padded_shape(n, k)
            nbytes = np_ * kp * 9 // 16
            qws = [random_packed(n, k, gen) for _ in range(max(2, math.ceil(4 * L2_BYTES / nbytes)))]
            yield model, layer, n, k, nbytes, qws


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", help="directory holding the other nvfp4_kernel.cu (+ its headers)")
    ap.add_argument("--fixups", action="store_true", help="batched against serial v2 fixup in this build")
    ap.add_argument("--variants", default=None, help="comma-separated small-M variants of this build to compare")
    ap.add_argument("--prefetch", default=None, help="comma-separated L2 prefetch distances (tiles) to compare")
    ap.add_argument("--ms", default="1,8,16,32")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and kernel.available()):
        print(f"ab_kernel: needs CUDA and the extension ({kernel.build_error()})", file=sys.stderr)
        return 2
    if (bool(args.other) + args.fixups + bool(args.variants) + bool(args.prefetch)) != 1:
        ap.error("give one of --other DIR, --fixups, --variants LIST and --prefetch LIST")
    if args.variants:
        return compare_variants(args)
    if args.prefetch:
        return compare_prefetch(args)
    new = kernel._load()
    if args.fixups:
        other, fixup = new, {"new": 1, "old": 2}
    else:
        # built with exactly this build's flags (arch flags, -DQERL_HAS_SM90A: without it the other build never
        # runs the wgmma tiles; the headers' digest in the cache key), so that only the sources differ
        import os

        other = kernel.build_extension("qerl_nvfp4_ab", "nvfp4_kernel.cu", src_dir=args.other,
                                       timeline=os.environ.get("QERL_KERNEL_TIMELINE") == "1")
        fixup = {}
    for ext in (new, other):
        ext.set_variant(3)

    def use(e: str):  # the fixup of this side (the launch reads it when it is captured)
        if e in fixup:
            new.set_fixup(fixup[e])
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model, layer, n, k, _, qws in packed_weights(args.models, gen):
        cq = len(qws)
        gs = torch.tensor([2000.0], device="cuda")
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = {e: torch.empty(m, n, device="cuda", dtype=torch.bfloat16) for e in ("new", "old")}
            exts = {"new": new, "old": other}
            paths = {e: int(exts[e].choose_path(m, n, k)) for e in exts}
            for e in exts:  # same results (to the summation order) before timing
                use(e)
                exts[e].linear_out(x, qws[0], gs, n, k, out[e], -1)
            torch.cuda.synchronize()
            diff = float((out["new"].float() - out["old"].float()).norm() / out["old"].float().norm())
            times = {"new": [], "old": []}
            calls = cq * math.ceil(24 / cq)
            for _ in range(args.rounds):
                for e in ("new", "old"):
                    use(e)
                    times[e].append(1e6 * time_graph(
                        lambda i, e=e: exts[e].linear_out(x, qws[i], gs, n, k, out[e], -1), cq, calls))
            row = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "paths": paths, "rel_diff": diff,
                   "new_us": statistics.median(times["new"]), "old_us": statistics.median(times["old"]),
                   "new_all": times["new"], "old_all": times["old"]}
            rows.append(row)
            print(f"{model:12s} {layer:8s} m={m:3d}  new {row['new_us']:7.1f} us  old {row['old_us']:7.1f} us  "
                  f"({100 * (row['new_us'] / row['old_us'] - 1):+5.1f}%)  paths {paths}  diff {diff:.1e}",
                  flush=True)
    if fixup:
        new.set_fixup(0)
    if args.json:
        labels = {"new": "batched fixup", "old": "serial fixup"} if fixup else {"new": "this tree", "old": args.other}
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "labels": labels,
                                               "rows": rows}, indent=1))
    return 0


def compare_variants(args) -> int:
    """Forced small-M variants of this build side by side with cuBLAS bf16 (see the module docstring)."""
    ext = kernel._load()
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in kernel.VARIANTS]
    if bad:
        print(f"ab_kernel: unknown variant(s) {bad}; known: {sorted(kernel.VARIANTS)}", file=sys.stderr)
        return 2
    if "auto" not in names:
        names.append("auto")
    return compare_settings(args, {v: (lambda v=v: ext.set_variant(kernel.VARIANTS[v])) for v in names},
                            lambda: ext.set_variant(3), "variants")


def compare_prefetch(args) -> int:
    """The automatic path with each rolling L2 prefetch distance side by side with cuBLAS bf16."""
    ext = kernel._load()
    try:
        dists = [int(v) for v in args.prefetch.split(",") if v.strip()]
    except ValueError:
        print(f"ab_kernel: --prefetch takes whole numbers of tiles, not {args.prefetch!r}", file=sys.stderr)
        return 2
    if not ext.has_v2_prefetch():
        print("ab_kernel: this kernel build has no rolling L2 prefetch: add -DQERL_V2_PREFETCH_LOOP to "
              "QERL_KERNEL_ARCH_FLAGS", file=sys.stderr)
        return 2
    ext.set_variant(3)
    before = int(ext.get_v2_prefetch())
    return compare_settings(args, {f"pf{d}": (lambda d=d: kernel.set_v2_prefetch(d)) for d in dists},
                            lambda: ext.set_v2_prefetch(before), "prefetch")


def compare_settings(args, settings: dict, restore, what: str) -> int:
    """Each named setting (name -> a function applying it) of this build in turn, interleaved round by round,
    beside cuBLAS bf16; the first is the reference of the bit-identity column."""
    ext = kernel._load()
    names = list(settings)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model, layer, n, k, weight_bytes, qws in packed_weights(args.models, gen):
        cq = len(qws)
        cb = max(2, math.ceil(4 * L2_BYTES / (n * k * 2)))
        wbf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(cb)]
        gs = torch.tensor([2000.0], device="cuda")
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = {v: torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16) for v in names}
            for v in names:
                settings[v]()
                ext.linear_out(x, qws[0], gs, n, k, out[v], -1)
            torch.cuda.synchronize()
            ref = out[names[0]].float()
            same = {v: bool(torch.equal(out[v], out[names[0]])) for v in names}
            diff = {v: float((out[v].float() - ref).norm() / ref.norm()) for v in names}
            nan = {v: bool(torch.isnan(out[v]).any()) for v in names}
            times = {v: [] for v in names + ["cublas"]}
            calls = cq * math.ceil(24 / cq)
            yb = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            for _ in range(args.rounds):
                for v in names:
                    settings[v]()
                    times[v].append(1e6 * time_graph(
                        lambda i, v=v: ext.linear_out(x, qws[i], gs, n, k, out[v], -1), cq, calls))
                times["cublas"].append(1e6 * time_graph(
                    lambda i: torch.matmul(x, wbf[i].t(), out=yb), cb, cb * math.ceil(24 / cb)))
            med = {v: statistics.median(ts) for v, ts in times.items()}
            row = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "us": med, "all": times,
                   "same_bits_as_first": same, "rel_diff": diff, "nan": nan, "weight_bytes": weight_bytes}
            rows.append(row)
            cells = "  ".join(f"{v} {med[v]:6.1f}{'' if same[v] else '*'}" for v in names)
            best = min(names, key=lambda v: med[v])
            print(f"{model:12s} {layer:8s} m={m:3d}  {cells}  cuBLAS {med['cublas']:6.1f}  best {best} "
                  f"x{med['cublas'] / med[best]:4.2f} ({weight_bytes / med[best] / 1e3:5.0f} GB/s)"
                  f"{'  NaN!' if any(nan.values()) else ''}", flush=True)
        del wbf
    restore()
    print("(* = not bit-identical to the first setting; relative differences in the JSON)")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), what: names,
                                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
