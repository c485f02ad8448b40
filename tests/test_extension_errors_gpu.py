"""Bad arguments to the CUDA extensions' C++ functions (TORCH_CHECK failures) come back to Python as one clear
RuntimeError, and the process goes on working: each call runs in a child process, so a crash (as one throw from
qerl_fused's lora_add did on the H200 in session 7) fails this test instead of killing the test run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[1]

CHILD = textwrap.dedent(r"""
    import sys, torch
    from qerl_cli import fused, kernel

    ext, fx = kernel._load(), fused._load()
    assert ext is not None and fx is not None, (kernel.build_error(), fused.build_error())
    dev = dict(device="cuda")
    bf = dict(device="cuda", dtype=torch.bfloat16)
    n, k = 64, 128
    qw = torch.zeros((n + 15) // 16, (k + 63) // 64, 576, dtype=torch.uint8, **dev)
    gs = torch.ones(1, **dev)
    x = torch.randn(4, k, **bf)
    cases = {
        "linear_out x width": lambda: ext.linear_out(x[:, :64].contiguous(), qw, gs, n, k, torch.empty(4, n, **bf), -1),
        "linear_out qweight dtype": lambda: ext.linear_out(x, qw.float(), gs, n, k, torch.empty(4, n, **bf), -1),
        "linear_out out shape": lambda: ext.linear_out(x, qw, gs, n, k, torch.empty(4, n + 2, **bf), -1),
        "linear_out qweight shape": lambda: ext.linear_out(x, qw[:2].contiguous(), gs, n, k, torch.empty(4, n, **bf), 0),
        "dequantize_out out shape": lambda: ext.dequantize_out(qw, gs, n, k, torch.empty(n, k + 16, **bf)),
        "dequantize_out dtype": lambda: ext.dequantize_out(qw, gs, n, k, torch.empty(n, k, dtype=torch.int32, **dev)),
        "linear_t_out g width": lambda: ext.linear_t_out(torch.randn(4, n + 1, **bf), qw, gs, n, k,
                                                         torch.empty(4, k, **bf)),
        "set_variant": lambda: ext.set_variant(9),
        "set_fixup": lambda: ext.set_fixup(7),
        "set_cluster_max_m": lambda: ext.set_cluster_max_m(-1),
        "set_split_override": lambda: ext.set_split_override(-1),
        "set_v2_grid": lambda: ext.set_v2_grid(-1),
        "add_rmsnorm dtype": lambda: fx.add_rmsnorm(x.float(), None, torch.ones(k, **bf), 1, x.float(), x.float(), 1e-5),
        "silu_mul shapes": lambda: fx.silu_mul(x, x[:2], torch.empty_like(x)),
        "rope_kv shapes": lambda: fx.rope_kv(torch.randn(2, 5 * 16, **bf), torch.randn(2, 16, **bf),
                                             torch.randn(2, 16, **bf), torch.empty(2, 3, 1, 16, **bf),
                                             torch.zeros(2, 1, 8, 32, **bf), torch.zeros(2, 1, 8, 32, **bf),
                                             torch.zeros(1, dtype=torch.long, **dev), 1),
    }
    for name, call in cases.items():
        try:
            call()
            torch.cuda.synchronize()
        except RuntimeError as e:
            line = str(e).strip().splitlines()[0]
            print(f"raised\t{name}\t{line}", flush=True)
            continue
        print(f"no error\t{name}", flush=True)
    # the process and the device still work after every throw
    w = torch.zeros(n, k, **bf)
    ext.dequantize_out(qw, gs, n, k, w)
    y = torch.empty(4, n, **bf)
    ext.linear_out(x, qw, gs, n, k, y, 0)
    torch.cuda.synchronize()
    print("alive\t" + str(bool(torch.equal(y, x @ w.t()))), flush=True)
""")


def test_bad_arguments_raise_runtime_errors_without_crashing():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from qerl_cli import fused, kernel

    if not (kernel.available() and fused.available()):
        pytest.skip(f"extensions not built: {kernel.build_error()} / {fused.build_error()}")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=900)
    lines = [ln.split("\t") for ln in res.stdout.splitlines()]
    assert res.returncode == 0, f"child exited {res.returncode} after {lines[-1:]}: {res.stderr[-2000:]}"
    raised = {ln[1]: ln[2] for ln in lines if ln[0] == "raised"}
    missing = [ln[1] for ln in lines if ln[0] == "no error"]
    assert not missing, f"no error raised for {missing}"
    assert len(raised) == 15 and all(msg.startswith("qerl") for msg in raised.values()), raised
    assert lines[-1] == ["alive", "True"], lines[-1]
