"""Launch the small-M kernel a few times on one shape (for `ncu`); not a benchmark by itself."""
import sys

import torch

sys.path.insert(0, "src")
from qerl_cli import kernel, layout  # noqa: E402

n, k, m = (int(v) for v in (sys.argv[1:4] if len(sys.argv) > 3 else (37888, 3584, 1)))
np_, kp = layout.padded_shape(n, k)
q = torch.randint(0, 256, (np_ // 16, kp // 64, 576), dtype=torch.uint8, device="cuda")
q[..., 512:] = torch.randint(0x30, 0x50, q[..., 512:].shape, dtype=torch.uint8, device="cuda")
gs = torch.tensor([2000.0], device="cuda")
x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    kernel.linear(x, q, gs, n, k)
torch.cuda.synchronize()
print("backend", kernel.last_backend())
