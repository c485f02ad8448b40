"""calibrate on CUDA (one layer at a time on the device) against the CPU run. Skipped without a GPU."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import SHARED_DATA, check_calib_report
from qerl_cli import artifact, calibrate, names

pytestmark = pytest.mark.gpu


def test_calibrate_on_cuda_matches_cpu(tiny_model_dir, tmp_path):
    kw = dict(samples=6, seq_len=48, field="question,answer", progress=False)
    data = str(SHARED_DATA / "gsm8k" / "train.jsonl")
    cpu = calibrate.calibrate(str(tiny_model_dir), data, tmp_path / "cpu", device="cpu", **kw)
    gpu = calibrate.calibrate(str(tiny_model_dir), data, tmp_path / "gpu", device="cuda", **kw)
    assert gpu.config["device"] == "cuda" and gpu.key != cpu.key  # a different run, cached apart
    sc, sg = (load_file(str(a.file(names.CALIB_SCALES))) for a in (cpu, gpu))
    assert sc.keys() == sg.keys() and all(v.device.type == "cpu" for v in sg.values())
    rc, rg = (json.loads(a.file(names.CALIB_REPORT).read_text())["groups"] for a in (cpu, gpu))
    check_calib_report(rc)  # the same guarantees on both devices (a group alone may lose a little to RTN
    check_calib_report(rg)  # when its consumer's fold gains more; each consumer/producer pair never does)
    for a, b in zip(rc, rg):
        assert (a["layer"], a["group"]) == (b["layer"], b["group"])
        assert b["error_rtn"] == pytest.approx(a["error_rtn"], rel=1e-3)
        assert b["error_awq"] == pytest.approx(a["error_awq"], rel=5e-2)  # a grid point may flip on a near tie
    same = sum(torch.allclose(sc[k], sg[k], rtol=1e-3) for k in sc)
    assert same >= len(sc) // 2
    assert artifact.open_artifact(gpu.path, names.KIND_CALIB).digest == gpu.digest
