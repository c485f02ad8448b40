"""NVFP4 x BF16 kernel vs cuBLAS bf16 (torch.matmul) on Qwen2.5-7B / -32B linear shapes, one GPU run.

For every shape and M it times, side by side in the same process with CUDA events over CUDA-graph replays
(launch overhead out of both), our ``kernel.linear`` and ``torch.matmul(x, W_bf16.t())``, rotating over
several weight copies so that the 50 MB L2 does not serve repeats. It also measures device-to-device copy
bandwidth, the ceiling for the "% of copy" column (weight bytes = 9/16 byte per weight over our time).

    PYTHONPATH=src python benchmarks/bench_kernel.py [--json benchmarks/results/kernel_h200.json] [--variant v2]

For M <= 16 it also times every forced small-M kernel variant side by side (columns ``alt``, ``v2`` (the
stream-K kernel) and ``dflt``); ``--variant`` picks the one behind ``ours`` (default: ``auto``, the per-shape
choice that ``kernel.linear`` makes).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from qerl_cli import kernel, layout  # noqa: E402

MODELS = {
    # name: (hidden, intermediate, heads, kv_heads, head_dim)
    "qwen2.5-7b": (3584, 18944, 28, 4, 128),
    "qwen2.5-32b": (5120, 27648, 40, 8, 128),
}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096]
L2_BYTES = 50 * 2**20


def shapes(model: str) -> list[tuple[str, int, int]]:
    h, inter, nh, nkv, hd = MODELS[model]
    return [("qkv", (nh + 2 * nkv) * hd, h), ("o", h, nh * hd), ("gate_up", 2 * inter, h), ("down", h, inter)]


def copy_bandwidth(nbytes: int = 2 * 2**30, reps: int = 20) -> float:
    """Device-to-device copy, bytes read + written per second (median of reps)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    a.random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(ts)


def capture_graph(fn, ncopies: int, calls: int) -> torch.cuda.CUDAGraph:
    """One CUDA graph of ``calls`` calls fn(i) (i cycles over the copies), after a warm-up on a side stream;
    replayed once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(min(ncopies, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i % ncopies)
    g.replay()
    torch.cuda.synchronize()
    return g


def time_graph(fn, ncopies: int, calls: int, reps: int = 5) -> float:
    """Median seconds per call of fn(i) (i cycles over the copies), captured in one CUDA graph."""
    g = capture_graph(fn, ncopies, calls)
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / calls)
    del g
    return statistics.median(ts)


def random_packed(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A valid packed weight with random codes and positive normal e4m3 scales (speed ignores values)."""
    np_, kp = layout.padded_shape(n, k)
    q = torch.randint(0, 256, (np_ // 16, kp // 64, layout.RECORD_BYTES), dtype=torch.uint8, device="cuda",
                      generator=gen)
    q[..., layout.CODE_BYTES:] = torch.randint(0x30, 0x50, (np_ // 16, kp // 64, layout.SCALE_BYTES),
                                               dtype=torch.uint8, device="cuda", generator=gen)
    return q


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results" / "kernel_h200.json"))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    ap.add_argument("--both-paths-from", type=int, default=32,
                    help="also time the mma kernel and dequantize+cuBLAS separately for M >= this (<= 1024)")
    ap.add_argument("--tiled-cfgs", default="",
                    help="comma-separated tiled configurations to time (default: every one this device runs)")
    ap.add_argument("--tiled-from", type=int, default=32,
                    help="also time the tiled tensor-core kernel (path 2), each tile forced, for M >= this")
    ap.add_argument("--variant", default="auto", choices=sorted(kernel.VARIANTS),
                    help="small-M kernel variant used for the 'ours' column")
    args = ap.parse_args()
    asked = [v.strip() for v in args.tiled_cfgs.split(",") if v.strip()]
    if not all(v in {str(c) for c in range(1, 8)} for v in asked):
        print(f"bench_kernel: --tiled-cfgs takes configurations 1-7, got {args.tiled_cfgs!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench_kernel: needs a CUDA device", file=sys.stderr)
        return 2
    if not kernel.available():
        print(f"bench_kernel: CUDA extension unavailable: {kernel.build_error()}", file=sys.stderr)
        return 2
    ext = kernel._load()
    # the tiled configurations this device runs: mma.sync 1-3, wgmma 4-7 on an sm_90a device
    tc_cfgs = (1, 2, 3) + ((4, 5, 6, 7) if ext.wgmma_available(torch.cuda.current_device()) else ())
    if args.tiled_cfgs:
        tc_cfgs = tuple(c for c in tc_cfgs if str(c) in asked)
    kernel.set_variant(args.variant)
    ours_code = kernel.VARIANTS[args.variant]
    ms = [int(v) for v in args.ms.split(",")]
    dev = torch.cuda.get_device_properties(0)
    t_start = time.time()
    copy_bw = copy_bandwidth()
    print(f"device: {dev.name}, {dev.multi_processor_count} SMs; torch {torch.__version__}; "
          f"copy bandwidth {copy_bw / 1e12:.2f} TB/s (read+write); large-M threshold {kernel.large_m_threshold()}",
          flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model in args.models.split(","):
        for layer, n, k in shapes(model):
            packed_bytes = layout.padded_shape(n, k)[0] * layout.padded_shape(n, k)[1] * 9 // 16
            weight_bytes = n * k * 9 / 16
            bf16_bytes = n * k * 2
            cq = max(2, math.ceil(4 * L2_BYTES / packed_bytes))
            cb = max(2, math.ceil(4 * L2_BYTES / bf16_bytes))
            qws = [random_packed(n, k, gen) for _ in range(cq)]
            gs = torch.tensor([2000.0], device="cuda")
            wbs = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(cb)]
            w32 = layout.dequantize(qws[0], gs, n, k, torch.float32)
            for m in ms:
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                out_b = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                # correctness spot check on fresh inputs, poisoned output
                out.fill_(float("nan"))
                kernel.linear(x, qws[0], gs, n, k, out=out)
                path = kernel.last_backend()
                ref = x.float() @ w32.t() if m <= 1024 else None
                err = float((out.float() - ref).norm() / ref.norm()) if ref is not None else None
                nan = bool(torch.isnan(out).any())
                del ref
                calls_target = 24 if m <= 256 else 6
                ours = time_graph(lambda i: kernel.linear(x, qws[i], gs, n, k, out=out), cq,
                                  cq * math.ceil(calls_target / cq))
                cublas = time_graph(lambda i: torch.mm(x, wbs[i].t(), out=out_b), cb, cb * math.ceil(calls_target / cb))
                row = {"model": model, "layer": layer, "n": n, "k": k, "m": m, "path": path,
                       "ours_us": ours * 1e6, "cublas_us": cublas * 1e6, "speedup": cublas / ours,
                       "weight_gbps": weight_bytes / ours / 1e9, "pct_copy_bw": 100 * weight_bytes / ours / copy_bw,
                       "tflops": 2 * m * n * k / ours / 1e12, "cublas_tflops": 2 * m * n * k / cublas / 1e12,
                       "rel_err": err, "nan": nan}
                if m <= kernel.large_m_threshold():  # the same calls without programmatic dependent launch
                    kernel.set_pdl(False)
                    row["ours_nopdl_us"] = 1e6 * time_graph(lambda i: kernel.linear(x, qws[i], gs, n, k, out=out), cq,
                                                            cq * math.ceil(calls_target / cq))
                    kernel.set_pdl(True)
                if args.both_paths_from <= m <= 1024:
                    row["mma_us"] = 1e6 * time_graph(lambda i: ext.linear_out(x, qws[i], gs, n, k, out, 0), cq,
                                                     cq * math.ceil(calls_target / cq))
                    row["dequant_cublas_us"] = 1e6 * time_graph(
                        lambda i: ext.linear_out(x, qws[i], gs, n, k, out, 1), cq, cq * math.ceil(calls_target / cq))
                if args.tiled_from <= m and hasattr(ext, "set_tc_cfg"):
                    # the tiled tensor-core kernel (path 2), each tile configuration forced, with the split it chose
                    for cfg in tc_cfgs:
                        ext.set_tc_cfg(cfg)
                        out.fill_(float("nan"))
                        ext.linear_out(x, qws[0], gs, n, k, out, 2)
                        row[f"tc{cfg}_split"] = int(ext.last_tc()) % 1000
                        if m <= 1024:
                            ref2 = x.float() @ w32.t()
                            row[f"tc{cfg}_rel_err"] = float((out.float() - ref2).norm() / ref2.norm())
                            del ref2
                        row[f"tc{cfg}_nan"] = bool(torch.isnan(out).any())
                        row[f"tc{cfg}_us"] = 1e6 * time_graph(
                            lambda i: ext.linear_out(x, qws[i], gs, n, k, out, 2), cq,
                            cq * math.ceil(calls_target / cq))
                    ext.set_tc_cfg(0)

                def time_forced(code: int) -> float:
                    """us per call of the mma path with small-M variant `code` forced."""
                    ext.set_variant(code)
                    return 1e6 * time_graph(lambda i: ext.linear_out(x, qws[i], gs, n, k, out, 0), cq,
                                            cq * math.ceil(calls_target / cq))

                def time_v1_configs(tag: str) -> None:
                    """Both configurations of the v1 kernel, with the K split each launch chose."""
                    for name, code in (("alt", 1), ("default", 0)):
                        row[f"{name}_{tag}_us"] = time_forced(code)
                        row[f"{name}_{tag}_split"] = int(ext.last_split())

                if m <= 64:  # every forced small-M variant side by side: alternative configuration, v2, default
                    for key, code in (("alt_variant_us", 1), ("v2_us", 2), ("default_variant_us", 0),
                                      ("v2w8_us", 4), ("v2w10_us", 5)):
                        if code == ours_code or (code in (2, 4, 5) and m > 16):  # (forced up to M = 16 here)
                            continue
                        ext.set_variant(code)
                        if key == "v2_us":  # correctness of v2 on the same poisoned-output check
                            out.fill_(float("nan"))
                            ext.linear_out(x, qws[0], gs, n, k, out, 0)
                            ref2 = x.float() @ w32.t()
                            row["v2_rel_err"] = float((out.float() - ref2).norm() / ref2.norm())
                            row["v2_nan"] = bool(torch.isnan(out).any())
                            del ref2
                        row[key] = time_forced(code)
                    # the two v1-kernel variants with their K splits reduced through the fp32 workspace
                    # instead of thread-block clusters (the split then is chosen without the cap of 8)
                    kernel.set_cluster(False)
                    time_v1_configs("nocluster")
                    kernel.set_cluster(True)
                    ext.set_split_override(8)  # the alternative configuration with a forced cluster of 8 splits
                    row["alt_cluster8_us"] = time_forced(1)
                    ext.set_split_override(0)
                    max_m = int(ext.get_cluster_max_m())
                    if m > max_m:  # clusters are off above the limit (16 by default): both v1 configurations with them
                        ext.set_cluster_max_m(m)
                        time_v1_configs("cluster")
                        ext.set_cluster_max_m(max_m)
                    for key, code in (("alt_split", 1), ("default_split", 0)):
                        ext.set_variant(code)
                        ext.linear_out(x, qws[0], gs, n, k, out, 0)
                        row[key] = int(ext.last_split())  # negative: reduced in a cluster
                    ext.set_variant(ours_code)
                    if ours_code == 2:
                        row["v2_us"] = row["ours_us"]
                    if "v2_us" in row:
                        row["v2_speedup_vs_cublas"] = row["cublas_us"] / row["v2_us"]
                rows.append(row)
                alt = (f"  mma {row['mma_us']:8.1f}  deq+cublas {row['dequant_cublas_us']:8.1f}"
                       if "mma_us" in row else "")
                for cfg in (1, 2, 3):
                    if f"tc{cfg}_us" in row:
                        bad = ", NaN!" if row[f"tc{cfg}_nan"] else ""
                        e2 = row.get(f"tc{cfg}_rel_err")
                        alt += (f"  tc{cfg} {row[f'tc{cfg}_us']:7.1f} (S {row[f'tc{cfg}_split']}, x"
                                f"{row['cublas_us'] / row[f'tc{cfg}_us']:4.2f}"
                                f"{'' if e2 is None else f', err {e2:.1e}'}{bad})")
                alt += f"  no-PDL {row['ours_nopdl_us']:7.1f}" if "ours_nopdl_us" in row else ""
                alt += f"  alt {row['alt_variant_us']:6.1f}" if "alt_variant_us" in row else ""
                alt += f"  dflt {row['default_variant_us']:6.1f}" if "default_variant_us" in row else ""
                alt += f"  v2w8 {row['v2w8_us']:6.1f}" if "v2w8_us" in row else ""
                alt += f"  v2w10 {row['v2w10_us']:6.1f}" if "v2w10_us" in row else ""
                if "alt_nocluster_us" in row:
                    alt += (f"  no-cluster alt {row['alt_nocluster_us']:6.1f} (S {row['alt_nocluster_split']} vs "
                            f"{row['alt_split']}) dflt {row['default_nocluster_us']:6.1f} (S "
                            f"{row['default_nocluster_split']} vs {row['default_split']}) alt-cl8 "
                            f"{row['alt_cluster8_us']:6.1f}")
                if "alt_cluster_us" in row:
                    alt += (f"  clusters alt {row['alt_cluster_us']:6.1f} (S {row['alt_cluster_split']}) dflt "
                            f"{row['default_cluster_us']:6.1f} (S {row['default_cluster_split']})")
                if "v2_us" in row:
                    v2err = f", err {row['v2_rel_err']:.1e}" if "v2_rel_err" in row else ""
                    v2nan = ", NaN!" if row.get("v2_nan") else ""
                    alt += f"  v2 {row['v2_us']:6.1f} (x{row['v2_speedup_vs_cublas']:4.2f} vs cuBLAS{v2err}{v2nan})"
                print(f"{model:12s} {layer:8s} {n:6d} {k:6d} {m:5d} {path:20s} ours {row['ours_us']:9.1f} us  "
                      f"cublas {row['cublas_us']:9.1f} us  x{row['speedup']:5.2f}  {row['weight_gbps']:7.0f} GB/s "
                      f"({row['pct_copy_bw']:5.1f}%)  {row['tflops']:6.1f} TF/s  "
                      f"err {err if err is None else f'{err:.1e}'}"
                      f"{alt}", flush=True)
                del x, out, out_b
            del qws, wbs, w32
            torch.cuda.empty_cache()
    result = {"device": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
              "cuda": torch.version.cuda, "host": platform.node(), "copy_bw_bytes_per_s": copy_bw,
              "large_m_threshold": kernel.large_m_threshold(), "variant": args.variant,
              "timing": "median of 5 CUDA-graph replays, weights rotated over copies totalling >= 200 MB; ours = "
              "kernel.linear (auto path), with programmatic dependent launch (each call's prologue overlaps the "
              "previous call; ours_nopdl_us: without it); *_nocluster_us: the v1 kernel's split-K through the "
              "workspace instead of thread-block clusters; *_split: its K split (negative: reduced in a cluster); "
              "*_cluster_us (M > 16): with clusters allowed there; tc1..tc7_us: the tiled tensor-core kernels "
              "(path 2) with one tile forced: mma.sync 1 128x128 (8 warps), 2 128x64 (8 warps), 3 128x64 (4 warps); "
              "wgmma (sm_90a only) 4 128x128, 5 256x128, 6 128x64, 7 64x128 (rows x tokens); tc*_split its K split",
              "wall_s": time.time() - t_start, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print_table(result)
    return 0


def print_table(result: dict) -> None:
    print(f"\n{result['device']}: copy bandwidth {result['copy_bw_bytes_per_s'] / 1e12:.2f} TB/s")
    print(f"ours = small-M variant {result.get('variant', 'default')}")
    hdr = ("| model | layer | N | K | M | path | ours µs | cuBLAS µs | speed-up | GB/s | % copy | TFLOP/s "
           "| ours without PDL µs | v2 µs | v2 speed-up | deq+cuBLAS µs | tiled µs (tile) | tiled speed-up |")
    print(hdr)
    print("|" + "---|" * (hdr.count("|") - 1))
    for r in result["rows"]:
        path = {kernel.BACKEND_KERNEL: "mma", kernel.BACKEND_TILED: "tiled"}.get(r["path"], "deq+cuBLAS")
        v2 = (f"{r['v2_us']:.1f} | {r['v2_speedup_vs_cublas']:.2f}" if "v2_us" in r else "— | —")
        v2 = (f"{r['ours_nopdl_us']:.1f} | " if "ours_nopdl_us" in r else "— | ") + v2
        tcs = [(r[f"tc{c}_us"], c) for c in range(1, 8) if f"tc{c}_us" in r]
        tiled = (f"{min(tcs)[0]:.1f} (tc{min(tcs)[1]}) | {r['cublas_us'] / min(tcs)[0]:.2f}" if tcs else "— | —")
        deq = f"{r['dequant_cublas_us']:.1f}" if "dequant_cublas_us" in r else "—"
        print(f"| {r['model']} | {r['layer']} | {r['n']} | {r['k']} | {r['m']} | {path} | {r['ours_us']:.1f} | "
              f"{r['cublas_us']:.1f} | {r['speedup']:.2f} | {r['weight_gbps']:.0f} | {r['pct_copy_bw']:.0f} | "
              f"{r['tflops']:.1f} | {v2} | {deq} | {tiled} |")


if __name__ == "__main__":
    raise SystemExit(main())
