"""The repository's shell scripts parse (``bash -n``): a device session script with a broken case block fails only
when its call has already cost device time."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted({p for p in ROOT.glob("**/*.sh") if ".venv" not in p.parts and "node_modules" not in p.parts}
                 | {ROOT / ".ci" / "run"})


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_script_parses(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_gpu_session_parts_are_unique():
    """Every part of benchmarks/gpu_session.sh is one case label (a duplicate one would never run)."""
    lines = (ROOT / "benchmarks" / "gpu_session.sh").read_text().splitlines()
    labels = [ln[:-1] for ln in lines if ln[:1].isdigit() and ln.endswith(")") and ln[:-1].isdigit()]
    assert len(labels) > 10 and len(labels) == len(set(labels)), labels


def test_bench_kernel_refuses_unknown_tiled_configuration():
    """A tile number the kernels do not have is one sentence and exit 2, before any device is asked for."""
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_kernel.py"), "--tiled-cfgs", "4,9"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--tiled-cfgs takes configurations 1-7, got '4,9'" in r.stderr, r.stderr
