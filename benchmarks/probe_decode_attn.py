"""Where the time of fused.decode_attn goes: a sweep of its splits, with and without PDL, against SDPA and a floor.

Session 17 measured the kernel at 0.47-0.79x SDPA (bench_decode_attn.py). This probe times, in CUDA-graph replays
with the caches rotated past the L2 (as bench_decode_attn.py does), for a few 7B-shape steps:
  * ``sdpa``        F.scaled_dot_product_attention over the whole cache with the additive mask
  * ``floor``       a kernel of the same output size that does no work (``out.zero_()``): the launch floor
  * ``splits=N``    fused.decode_attn with N blocks per (row, KV head) (0: the launcher's choice), PDL on
  * ``nopdl``       the launcher's choice with programmatic dependent launch off
  * ``ws:splits=N`` the same N with the splits added through the workspace instead of a cluster
and prints one row per shape, µs per call. ``--ncu`` instead runs each of the two kernels twice eagerly between
cudaProfilerStart/Stop (for ``ncu --profile-from-start off``) and exits. Writes JSON with ``--json``.

    PYTHONPATH=src python benchmarks/probe_decode_attn.py [--json out.json] [--ncu]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernel import L2_BYTES, time_graph  # noqa: E402
from qerl_cli import fused  # noqa: E402

SHAPES = [(8, 768, 257), (8, 768, 512), (8, 768, 768), (64, 768, 512)]  # 7B heads: 28 query, 4 KV, D = 128
SPLITS = [0, 6, 8, 12, 16, 32]  # (cluster where 2 ... 8 on sm_90; "ws" columns: through the workspace)
WS_SPLITS = [0, 8]


def setup(b: int, s_len: int, n: int, gen: torch.Generator, copies: int):
    h, kv, d = 28, 4, 128
    caches = [(torch.randn(b, kv, s_len, d, device="cuda", generator=gen).bfloat16(),
               torch.randn(b, kv, s_len, d, device="cuda", generator=gen).bfloat16()) for _ in range(copies)]
    q = torch.randn(b, h, 1, d, device="cuda", generator=gen).bfloat16()
    key_mask = torch.ones(b, s_len, dtype=torch.bool, device="cuda")
    slot = torch.tensor([n - 1], device="cuda")
    allowed = key_mask & (torch.arange(s_len, device="cuda") < n)
    add = torch.zeros(b, 1, 1, s_len, dtype=torch.bfloat16, device="cuda").masked_fill(
        ~allowed[:, None, None, :], float("-inf"))
    return caches, q, key_mask, slot, add


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--ncu", action="store_true", help="run each kernel a few times eagerly for ncu, then exit")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and fused.available()):
        print(f"probe_decode_attn: needs CUDA and the fused kernels ({fused.build_error()})", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    if args.ncu:
        caches, q, key_mask, slot, add = setup(8, 768, 512, gen, 1)
        kc, vc = caches[0]
        for _ in range(3):  # warm-up (the first launches build nothing, but pick cuDNN's plan)
            F.scaled_dot_product_attention(q, kc, vc, attn_mask=add, enable_gqa=True)
            fused.decode_attn(q, kc, vc, key_mask, slot)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()  # ncu --profile-from-start off sees only these
        for _ in range(2):
            F.scaled_dot_product_attention(q, kc, vc, attn_mask=add, enable_gqa=True)
            fused.decode_attn(q, kc, vc, key_mask, slot)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return 0
    ext = fused._load()
    rows = []
    cols = ["sdpa", "floor", "nopdl"] + [f"splits={s}" for s in SPLITS] + [f"ws:splits={s}" for s in WS_SPLITS]
    print(f"{'B':>4} {'S':>5} {'n':>5} " + " ".join(f"{c:>11}" for c in cols), flush=True)
    for b, s_len, n in SHAPES:
        per_copy = 2 * b * 4 * s_len * 128 * 2
        copies = max(2, math.ceil(4 * L2_BYTES / per_copy))
        caches, q, key_mask, slot, add = setup(b, s_len, n, gen, copies)
        out = torch.empty(b, 1, 28 * 128, dtype=torch.bfloat16, device="cuda")
        t = {"sdpa": time_graph(lambda i: F.scaled_dot_product_attention(
            q, caches[i][0], caches[i][1], attn_mask=add, enable_gqa=True), copies, 200)}
        t["floor"] = time_graph(lambda i: out.zero_(), copies, 200)
        ext.set_pdl(False)
        try:
            t["nopdl"] = time_graph(lambda i: fused.decode_attn(q, caches[i][0], caches[i][1], key_mask, slot),
                                    copies, 200)
        finally:
            ext.set_pdl(True)
        for s in SPLITS:
            t[f"splits={s}"] = time_graph(
                lambda i, s=s: fused.decode_attn(q, caches[i][0], caches[i][1], key_mask, slot, splits=s), copies, 200)
        for s in WS_SPLITS:
            t[f"ws:splits={s}"] = time_graph(lambda i, s=s: fused.decode_attn(
                q, caches[i][0], caches[i][1], key_mask, slot, splits=s, cluster=False), copies, 200)
        us = {k: 1e6 * v for k, v in t.items()}
        rows.append({"batch": b, "cache_slots": s_len, "attended": n, "us": us})
        print(f"{b:>4} {s_len:>5} {n:>5} " + " ".join(f"{us[c]:>11.1f}" for c in cols), flush=True)
        caches = None  # (the lambdas above are done with them)
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
