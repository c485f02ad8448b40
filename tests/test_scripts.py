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


def test_main_job_makefile_remakes_what_a_changed_setting_touches(tmp_path):
    """examples/smollm2 (make demo): a rerun does nothing; a changed setting remakes its stage and those after it
    with --force (they were "Nothing to be done", and a forced remake would have been refused); an interrupted
    train run is resumed (it failed with "holds an unfinished run")."""
    fake = tmp_path / "qerl"
    log = tmp_path / "calls"
    fake.write_text(f"""#!/usr/bin/env bash
o=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && o="$a"; prev="$a"; done
echo "$1 $(basename "$o") $*" >> {log}
mkdir -p "$o" && touch "$o/manifest.json"
[ "$1" != train ] || touch "$o/train_config.json"
""")
    fake.chmod(0o755)

    def make(*settings: str) -> list[str]:
        log.write_text("")
        subprocess.run(["make", "-s", "-C", str(ROOT / "examples" / "smollm2"), f"QERL={fake}",
                        f"OUT={tmp_path / 'out'}", *settings], check=True, capture_output=True, text=True)
        return log.read_text().splitlines()

    first = make()
    assert [c.split()[0] for c in first] == ["calibrate", "quantize", "pack", "verify", "train", "evaluate"]
    assert first[4].endswith("--force") and "--steps 2" in first[4]  # (a fresh run: nothing to resume)
    assert make() == []
    assert [c.split()[0] for c in make("SAMPLES=64")] == ["calibrate", "quantize", "pack", "verify", "train",
                                                          "evaluate"]
    assert all(c.endswith("--force") for c in make("SAMPLES=64", "STEPS=3"))
    (tmp_path / "out" / "run" / "manifest.json").unlink()  # an interrupted run
    again = make("SAMPLES=64", "STEPS=3")
    assert [c.split()[0] for c in again] == ["train", "evaluate"] and again[0].endswith("--resume")
    assert make("SAMPLES=64", "STEPS=3") == []
    # interrupted, then other settings: the unfinished run is of the old ones, so it is replaced, not resumed
    import time

    time.sleep(1.1)  # (file times of one second)
    (tmp_path / "out" / "run" / "manifest.json").unlink()
    changed = make("SAMPLES=64", "STEPS=4")
    assert changed[0].split()[0] == "train" and "--steps 4" in changed[0] and changed[0].endswith("--force")
