"""The two LoRA kernels alone (fused.lora_add, no base launch) on the Qwen2.5-7B groups at M = 8, rank 32 per
member, for Nsight Compute to time each launch serialized (session 8: `ncu_lora_s8b_h200.txt`):

    ncu --clock-control none --kernel-name regex:lora --launch-count 12 --section SpeedOfLight \
        --section LaunchStats --section Occupancy --section WarpStateStats python3 benchmarks/ncu_lora.py
"""
import torch
from qerl_cli import fused
assert fused.available(), fused.build_error()
g = torch.Generator(device="cuda").manual_seed(0)
def r(*s, sc=1.0): return (torch.randn(*s, device="cuda", generator=g) * sc).to(torch.bfloat16)
for name, k, sizes in (("qkv", 3584, (3584, 512, 512)), ("gate_up", 3584, (18944, 18944)), ("down", 18944, (3584,))):
    R = 32 * len(sizes); n = sum(sizes)
    x, a, y = r(8, k), r(R, k, sc=0.05), r(8, n)
    bs = torch.zeros(R, n, dtype=torch.bfloat16, device="cuda"); segs = []; col = 0
    for j, s in enumerate(sizes):
        bs[32 * j: 32 * (j + 1), col: col + s] = r(32, s, sc=0.05); col += s; segs += [col, 32 * j, 32 * (j + 1)]
    for _ in range(2):
        out = fused.lora_add(y, x, a, bs, tuple(segs))
    torch.cuda.synchronize()
    print(name, "ok", out is not None, flush=True)
