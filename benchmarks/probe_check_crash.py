"""Which failing argument checks of the two CUDA extensions crash the process: each case in a child process,
with default settings, with C++ stack traces and without addr2line.

Session 8 on the H200 (benchmarks/results/check_bisect_s8_h200.log, run before csrc/check.cuh existed): every
TORCH_CHECK whose message streamed an integer segfaulted (linear_out's and linear_t_out's shape checks); every one
whose message was string literals or C strings raised a RuntimeError. QERL_CHECK (csrc/check.cuh) now formats those
messages with snprintf; tests/test_extension_errors_gpu.py covers every check in a child process.

    PYTHONPATH=src python benchmarks/probe_check_crash.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

CASES = {
    "set_variant": "ext.set_variant(9)",
    "dequantize_out_literal": "ext.dequantize_out(qw, gs, n, k, torch.empty(n, k + 16, **bf))",
    "linear_t_out_fmt": "ext.linear_t_out(torch.randn(4, n + 1, **bf), qw, gs, n, k, torch.empty(4, k, **bf))",
    "linear_out_fmt": "ext.linear_out(x[:, :64].contiguous(), qw, gs, n, k, torch.empty(4, n, **bf), -1)",
    "linear_out_literal": "ext.linear_out(x, qw, gs, n, k, torch.empty(4, n + 2, **bf), -1)",
    "check_packed_cpu": "ext.dequantize_out(qw.cpu(), gs, n, k, torch.empty(n, k, **bf))",
    "fused_add_rmsnorm": "fx.add_rmsnorm(x.float(), None, torch.ones(k, **bf), 1, x.float(), x.float(), 1e-5)",
    "fused_silu_literal": "fx.silu_mul(x, x[:2], torch.empty_like(x))",
}

PRE = """
import torch
from qerl_cli import fused, kernel
ext, fx = kernel._load(), fused._load()
bf = dict(device="cuda", dtype=torch.bfloat16)
n, k = 64, 128
qw = torch.zeros(4, 2, 576, dtype=torch.uint8, device="cuda")
gs = torch.ones(1, device="cuda")
x = torch.randn(4, k, **bf)
try:
    %s
    print("no error")
except RuntimeError as e:
    print("raised:", str(e).splitlines()[0][:100])
"""


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("probe_check_crash: needs a CUDA device and the two extensions", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    for env_extra in ({}, {"TORCH_SHOW_CPP_STACKTRACES": "1"}, {"TORCH_DISABLE_ADDR2LINE": "1"}):
        for name, call in CASES.items():
            r = subprocess.run([sys.executable, "-c", PRE % call], capture_output=True, text=True,
                               env=dict(env, **env_extra))
            print(env_extra, name, "rc", r.returncode, r.stdout.strip()[-120:], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
