"""One decode step's attention: our kernel (fused.decode_attn) against SDPA as the engine called it before, one GPU run.

For each shape (model heads, batch B, cache of S slots, the step at slot n - 1) it times, in CUDA-graph replays
with the caches rotated over copies that together exceed the L2 four times:
  * ``sdpa``  F.scaled_dot_product_attention over the whole cache with the additive [B, 1, 1, S] mask (the
              engine's decode step before session 16: every slot, every query head on its own)
  * ``ours``  fused.decode_attn: the slots [0, n) only, each KV head's rows read once for its query heads (its
              splits added in a thread-block cluster where there are 2 ... 8 of them, on sm_90)
  * ``ws``    the same with the splits added through the workspace (``cluster=False``)
and prints µs per call, the speed-up, the KV bytes our kernel reads per µs, and the largest difference between
the two outputs relative to the largest output. Writes the rows as JSON.

    PYTHONPATH=src python benchmarks/bench_decode_attn.py [--json out.json]
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

HEADS = {"qwen2.5-7b": (28, 4, 128), "qwen2.5-32b": (40, 8, 128), "smollm2": (9, 3, 64)}
# (model, batch, cache slots, attended slots n): the 7B rollout bench's cache is 256 + 512 = 768 slots, its steps
# attend to 257 ... 768 of them (512 on average); SmolLM2's is 128 + 256
SHAPES = [("qwen2.5-7b", 8, 768, 257), ("qwen2.5-7b", 8, 768, 512), ("qwen2.5-7b", 8, 768, 768),
          ("qwen2.5-7b", 32, 768, 512), ("qwen2.5-7b", 64, 768, 512), ("qwen2.5-7b", 64, 768, 768),
          ("qwen2.5-7b", 8, 4096, 2048), ("qwen2.5-32b", 8, 768, 512), ("smollm2", 64, 384, 256),
          ("smollm2", 256, 384, 256)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not (torch.cuda.is_available() and fused.available()):
        print(f"bench_decode_attn: needs CUDA and the fused kernels ({fused.build_error()})", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    print(f"{'shape':<12} {'B':>4} {'S':>5} {'n':>5} {'SDPA us':>8} {'ours us':>8} {'ws us':>8} {'speed-up':>8} "
          f"{'KV GB/s':>8} {'rel diff':>9}", flush=True)
    for model, b, s_len, n in SHAPES:
        h, kv, d = HEADS[model]
        per_copy = 2 * b * kv * s_len * d * 2
        copies = max(2, math.ceil(4 * L2_BYTES / per_copy))
        caches = [(torch.randn(b, kv, s_len, d, device="cuda", generator=gen).bfloat16(),
                   torch.randn(b, kv, s_len, d, device="cuda", generator=gen).bfloat16()) for _ in range(copies)]
        q = torch.randn(b, h, 1, d, device="cuda", generator=gen).bfloat16()
        key_mask = torch.ones(b, s_len, dtype=torch.bool, device="cuda")
        key_mask[:, : s_len // 16] = False  # some left padding
        slot = torch.tensor([n - 1], device="cuda")
        allowed = key_mask & (torch.arange(s_len, device="cuda") < n)
        allowed[:, n - 1] = True
        add = torch.zeros(b, 1, 1, s_len, dtype=torch.bfloat16, device="cuda").masked_fill(
            ~allowed[:, None, None, :], float("-inf"))

        def sdpa(i):
            kc, vc = caches[i]
            return F.scaled_dot_product_attention(q, kc, vc, attn_mask=add, enable_gqa=kv != h)

        def ours(i):
            kc, vc = caches[i]
            return fused.decode_attn(q, kc, vc, key_mask, slot)

        def ours_ws(i):
            kc, vc = caches[i]
            return fused.decode_attn(q, kc, vc, key_mask, slot, cluster=False)

        ref = sdpa(0).transpose(1, 2).reshape(b, 1, h * d).float()
        got = ours(0)
        diff = float((got.float() - ref).abs().max() / ref.abs().max())
        t_sdpa = 1e6 * time_graph(sdpa, copies, 200)
        t_ours = 1e6 * time_graph(ours, copies, 200)
        t_ws = 1e6 * time_graph(ours_ws, copies, 200)
        gbs = 2 * b * kv * n * d * 2 / (t_ours * 1e3)
        row = {"model": model, "batch": b, "cache_slots": s_len, "attended": n, "sdpa_us": t_sdpa, "ours_us": t_ours, "ours_workspace_us": t_ws,
               "speedup": t_sdpa / t_ours, "kv_gb_per_s": gbs, "rel_diff_vs_sdpa": diff}
        rows.append(row)
        print(f"{model:<12} {b:>4} {s_len:>5} {n:>5} {t_sdpa:>8.1f} {t_ours:>8.1f} {t_ws:>8.1f} {t_sdpa / t_ours:>7.2f}x "
              f"{gbs:>8.0f} {diff:>9.1e}", flush=True)
        del caches
        torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
