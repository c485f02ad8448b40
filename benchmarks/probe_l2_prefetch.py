"""What an L2 prefetch of part of a packed weight, issued while the GPU waits, saves the small-M product that
then streams it: one GPU run, CUDA-graph replays, weights rotated past the L2.

Per 7B / 32B gate/up and down shape at M = 8, for each prefetch size X (MiB from the weight's start) it times
the sequence ``sleep(T) -> fused.l2_prefetch(w, X) -> sleep(T) -> kernel.linear(x, w)`` (``torch.cuda._sleep``
stands in for the latency-bound kernels of a layer, during which DRAM is idle) and reports the time per
sequence less that of X = 0: the product's gain (negative: faster), the prefetch kernel's launch included.

    PYTHONPATH=src python benchmarks/probe_l2_prefetch.py [--sizes 0,8,16,24,32,40,48] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel import L2_BYTES, MODELS, random_packed, shapes, time_graph  # noqa: E402
from qerl_cli import fused, kernel, layout  # noqa: E402


def sleep_cycles(us: float) -> int:
    """Clock cycles of ``torch.cuda._sleep`` for about ``us`` microseconds (measured once)."""
    n = 100_000
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(n)
    e0.record()
    for _ in range(10):
        torch.cuda._sleep(n)
    e1.record()
    e1.synchronize()
    return int(n * us / (1000 * e0.elapsed_time(e1) / 10))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="0,8,16,24,32,40,48", help="prefetch sizes, MiB")
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--wait-us", type=float, default=15.0, help="each sleep, microseconds")
    ap.add_argument("--models", default="qwen2.5-7b,qwen2.5-32b")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and kernel.available() and fused.available()):
        print(f"probe_l2_prefetch: needs CUDA and both extensions ({kernel.build_error()}, {fused.build_error()})",
              file=sys.stderr)
        return 2
    sizes = [float(s) for s in args.sizes.split(",")]
    cyc = sleep_cycles(args.wait_us)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'shape':<16} {'MiB of weight':>13} " + " ".join(f"{s:>7g}" for s in sizes) + "   (us per product, "
          f"gain against 0)", flush=True)
    for model in args.models.split(","):
        for layer, n, k in shapes(model):
            if layer not in ("gate_up", "down"):
                continue
            np_, kp = layout.padded_shape(n, k)
            packed = np_ * kp * 9 // 16
            cq = max(2, math.ceil(4 * L2_BYTES / packed))
            qws = [random_packed(n, k, gen) for _ in range(cq)]
            gs = torch.tensor([2000.0], device="cuda")
            x = torch.randn(args.m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            out = torch.empty(args.m, n, device="cuda", dtype=torch.bfloat16)
            calls = cq * max(1, 120 // cq)
            base_seq = 1e6 * time_graph(lambda i: (torch.cuda._sleep(cyc), torch.cuda._sleep(cyc)), cq, calls)
            times = {}
            for s in sizes:
                nb = int(s * 2**20)

                def seq(i, nb=nb):
                    torch.cuda._sleep(cyc)
                    if nb:
                        fused.l2_prefetch(qws[i], nb)
                    torch.cuda._sleep(cyc)
                    kernel.linear(x, qws[i], gs, n, k, out=out)

                times[s] = 1e6 * time_graph(seq, cq, calls) - base_seq
            rows.append({"model": model, "layer": layer, "n": n, "k": k, "m": args.m, "packed_mib": packed / 2**20,
                         "wait_us": args.wait_us, "us": {f"{s:g}": t for s, t in times.items()}})
            print(f"{model[6:]} {layer:<9} {packed / 2**20:>13.1f} " + " ".join(f"{times[s]:>7.1f}" for s in sizes),
                  flush=True)
            del qws
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
