"""Where the time of a small-M NVFP4 launch goes: floors next to our kernel, one GPU run.

For the Qwen2.5-7B linear shapes at one M it times, in CUDA-graph replays (weights rotated past the L2):
  * ``ours``      kernel.linear (auto variant)
  * ``cublas``    torch.mm with bf16 weights
  * ``copy``      a device copy moving as many bytes as our packed weight (half read, half written): the
                  memory floor of a launch of that size
  * ``launch``    a graph of 64-element fills: the per-launch floor of a graph
With ``--ncu`` it instead runs each of our launches (and cuBLAS's) a few times eagerly, for
``ncu --kernel-name regex:...`` to read their counters (benchmarks/gpu_session.sh part 10).
With ``--lora R`` it times what a rank-R adapter adds to each fused group (q/k/v: three members, gate/up: two):
the base launch alone, base + the engine's cuBLAS terms (``x @ A^T`` then ``addmm``), base + the fused LoRA
kernels (``fused.lora_add`` with the members' segments), base + the expand alone (the shrink made beforehand, as
the fused norm / SiLU·mul kernels make it) and, where the kernel takes it, the term inside the NVFP4 kernel
(``kernel.linear_lora``, same shrink).

    PYTHONPATH=src python benchmarks/probe_small.py [--m 8] [--json out.json] [--ncu | --lora 32]
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
from qerl_cli import kernel, layout  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=8)
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ncu", action="store_true", help="eager launches for ncu instead of timings")
    ap.add_argument("--lora", type=int, default=0, help="rank: time the LoRA terms of each fused group instead")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and kernel.available()):
        print(f"probe_small: needs CUDA and the extension ({kernel.build_error()})", file=sys.stderr)
        return 2
    if args.lora:
        return lora_probe(args)
    gen = torch.Generator(device="cuda").manual_seed(0)
    m = args.m
    rows = []
    fill = torch.empty(64, device="cuda")
    launch_us = 1e6 * time_graph(lambda i: fill.fill_(float(i)), 4, 400)
    print(f"graph launch floor (64-element fill): {launch_us:.2f} us", flush=True)
    for layer, n, k in shapes(args.model):
        np_, kp = layout.padded_shape(n, k)
        packed = np_ * kp * 9 // 16
        cq = max(2, math.ceil(4 * L2_BYTES / packed))
        qws = [random_packed(n, k, gen) for _ in range(cq)]
        gs = torch.tensor([2000.0], device="cuda")
        wb = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        if args.ncu:  # only these launches between profiler start and stop (ncu --profile-from-start off)
            kernel.linear(x, qws[0], gs, n, k, out=out)
            torch.mm(x, wb.t(), out=out)
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            for i in range(2):
                kernel.linear(x, qws[i], gs, n, k, out=out)
            torch.mm(x, wb.t(), out=out)
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"{layer}: launched", flush=True)
            continue
        srcs = [torch.empty(packed // 2, dtype=torch.uint8, device="cuda") for _ in range(cq)]
        dst = torch.empty(packed // 2, dtype=torch.uint8, device="cuda")
        cb = max(2, math.ceil(4 * L2_BYTES / (n * k * 2)))
        wbs = [wb] + [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(cb - 1)]
        calls = max(cq, cb) * max(1, 400 // max(cq, cb))
        row = {
            "layer": layer, "n": n, "k": k, "m": m, "packed_bytes": packed,
            "ours_us": 1e6 * time_graph(lambda i: kernel.linear(x, qws[i % cq], gs, n, k, out=out), cq, calls),
            "cublas_us": 1e6 * time_graph(lambda i: torch.mm(x, wbs[i % cb].t(), out=out), cb, calls),
            "copy_us": 1e6 * time_graph(lambda i: dst.copy_(srcs[i % cq]), cq, calls),
            "launch_us": launch_us,
        }
        rows.append(row)
        print(f"{layer:8s} n={n:6d} k={k:6d} m={m}: ours {row['ours_us']:6.2f} us  cublas {row['cublas_us']:6.2f}  "
              f"copy-floor {row['copy_us']:6.2f}  launch-floor {launch_us:.2f}", flush=True)
        del qws, wbs, srcs
    if not args.ncu:  # decode attention of the 7B shape at batch 8 (28 query heads, 4 KV heads, 768 slots)
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        b, h, kv, d, slots = 8, 28, 4, 128, 768
        q = torch.randn(b, h, 1, d, device="cuda", dtype=torch.bfloat16)
        kc = [torch.randn(b, kv, slots, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        vc = [torch.randn(b, kv, slots, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        mask = torch.zeros(b, 1, 1, slots, device="cuda", dtype=torch.bfloat16)
        mask[:, :, :, 600:] = float("-inf")
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                         ("flash-nomask", SDPBackend.FLASH_ATTENTION), ("math", SDPBackend.MATH)):
            try:
                with sdpa_kernel([be]):
                    msk = None if name == "flash-nomask" else mask
                    us = 1e6 * time_graph(lambda i: F.scaled_dot_product_attention(
                        q, kc[i % 4], vc[i % 4], attn_mask=msk, enable_gqa=True), 4, 200)
            except Exception as e:  # a backend that does not take these inputs
                print(f"sdpa {name}: unavailable ({str(e).splitlines()[0][:120]})", flush=True)
                continue
            rows.append({"layer": "sdpa", "backend": name, "us": us, "b": b, "slots": slots})
            print(f"sdpa {name:12s} b={b} heads={h}/{kv} slots={slots}: {us:6.2f} us", flush=True)
    if args.json and rows:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1))
    return 0


def lora_probe(args) -> int:
    from qerl_cli import fused
    from qerl_cli.engine import _lora_add

    if not fused.available():
        print(f"probe_small: the fused kernels did not build ({fused.build_error()})", file=sys.stderr)
        return 2
    h, inter, nh, nkv, hd = MODELS[args.model]
    groups = {"qkv": [nh * hd, nkv * hd, nkv * hd], "o": [h], "gate_up": [inter, inter], "down": [h]}
    gen = torch.Generator(device="cuda").manual_seed(0)
    m, r, rows = args.m, args.lora, []
    for layer, n, k in shapes(args.model):
        sizes = groups[layer]
        np_, kp = layout.padded_shape(n, k)
        cq = max(2, math.ceil(4 * L2_BYTES / (np_ * kp * 9 // 16)))
        qws = [random_packed(n, k, gen) for _ in range(cq)]
        gs = torch.tensor([2000.0], device="cuda")
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        a = torch.randn(r * len(sizes), k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.05
        bs = torch.zeros(r * len(sizes), n, device="cuda", dtype=torch.bfloat16)
        segs, col = [], 0
        for j, size in enumerate(sizes):
            bs[j * r: (j + 1) * r, col: col + size] = torch.randn(r, size, device="cuda", generator=gen) * 0.05
            col += size
            segs += [col, j * r, (j + 1) * r]
        terms = (a, bs, tuple(segs))
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        calls = cq * max(1, 240 // cq)

        with torch.no_grad():
            hs = fused.lora_shrink(x, a)  # as a fused norm / SiLU·mul kernel would have made it

        def run(i, lora: str):
            if lora == "in_kernel":  # the term inside the NVFP4 kernel (session 14), the shrink already made
                return kernel.linear_lora(x, qws[i], gs, n, k, hs, bs, tuple(segs), out=out)
            y = kernel.linear(x, qws[i], gs, n, k, out=out)
            if lora == "expand":  # the separate expand kernel, the shrink already made
                return _lora_add(y, x, terms, kernels=True, shrunk=hs)
            return y if lora == "none" else _lora_add(y, x, terms, kernels=lora == "kernels")

        with torch.no_grad():
            check = {v: run(0, v).clone() for v in ("cublas", "kernels")}
            diff = float((check["kernels"].float() - check["cublas"].float()).norm() / check["cublas"].float().norm())
            row = {"layer": layer, "n": n, "k": k, "m": m, "rank": r, "members": len(sizes), "rel_diff": diff}
            modes = ["none", "cublas", "kernels", "expand"]
            if run(0, "in_kernel") is not None:  # (None: declined, e.g. the stream-K variants)
                modes.append("in_kernel")
            for v in modes:
                row[f"{v}_us"] = 1e6 * time_graph(lambda i, v=v: run(i, v), cq, calls)
        rows.append(row)
        inside = (f"{row['in_kernel_us'] - row['none_us']:+6.2f}" if "in_kernel_us" in row else "  n/a ")
        print(f"{layer:8s} n={n:6d} k={k:6d} m={m} rank {r}x{len(sizes)}: base {row['none_us']:6.2f} us  "
              f"+cuBLAS terms {row['cublas_us'] - row['none_us']:+6.2f}  +fused kernels "
              f"{row['kernels_us'] - row['none_us']:+6.2f}  +expand only {row['expand_us'] - row['none_us']:+6.2f}  "
              f"+term in our kernel {inside}  (diff {diff:.1e})", flush=True)
        del qws
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
