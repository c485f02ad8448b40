"""Integration: quantize -> pack -> verify on the real embedded SmolLM2-135M-Instruct through the real CLI."""

from __future__ import annotations

import json
import time

import pytest

from conftest import run_cli

from qerl_cli import artifact


def test_smollm2_quantize_pack_verify(tmp_path):
    quant, packed, ver = tmp_path / "quant", tmp_path / "packed", tmp_path / "verify"
    # a lighter verify (two batch sizes, one prompt) keeps the default test run short; checks and bounds are the shipped ones
    light = tmp_path / "verify.toml"
    light.write_text('batch_sizes = [1, 64]\nprompts = ["What is 7 + 5?"]\n')
    steps = [("quantize", "smollm2-135m-instruct", "-o", str(quant)), ("pack", str(quant), "-o", str(packed)),
             ("verify", str(packed), "-o", str(ver), "--config", str(light))]
    for args in steps:
        res = run_cli(*args, "--no-progress")
        if res.returncode and args[0] == "verify" and (ver / "report.json").is_file():  # (the failed checks, whole)
            checks = json.loads((ver / "report.json").read_text())["checks"]
            failed = {k: {f: v for f, v in c.items() if f != "layers"} | {"failed_layers": [
                r for r in c.get("layers", []) if not r.get("passed")][:5]} for k, c in checks.items() if not c["passed"]}
            pytest.fail(f"verify failed: {json.dumps(failed)[:4000]}")
        assert res.returncode == 0, (args, res.stdout, res.stderr)
        assert "Traceback" not in res.stderr
        if args[0] == "verify":
            assert "verify: PASSED" in res.stdout

    q = artifact.open_artifact(quant, "quant")
    assert q.config["method"] == "rtn"
    assert q.inputs[0]["kind"] == "model" and q.inputs[0]["path"] == "smollm2-135m-instruct"
    conf = json.loads((quant / "config.json").read_text())
    assert conf["num_hidden_layers"] == 30 and conf["hidden_size"] == 576 and conf["tie_word_embeddings"] is True
    assert conf["eos_token_id"] == 2 and conf["architectures"] == ["LlamaForCausalLM"]

    p = artifact.open_artifact(packed, "packed")
    assert p.metrics["linears"] == 30 * 7
    assert p.metrics["bytes_per_weight"] == 0.5625  # 4.5 bits: no padding at SmolLM2's shapes

    v = artifact.open_artifact(ver, "verify")
    assert v.metrics["passed"] is True
    report = json.loads((ver / "report.json").read_text())
    assert all(c["passed"] for c in report["checks"].values())
    assert report["checks"]["1_projections"]["batch_sizes"] == [1, 64]
    proj = report["checks"]["1_projections"]
    assert len(proj["layers"]) == 210 + 2 * 30  # every linear, plus the engine's fused q/k/v and gate/up
    assert proj["linears_checked"] == 210 and proj["fused_checked"] == 60
    assert report["checks"]["2_model"]["top1_agreement"] == 1.0

    # rerunning the whole chain does no work
    mtimes = {d: (d / "manifest.json").stat().st_mtime_ns for d in (quant, packed, ver)}
    t0 = time.perf_counter()
    for args in steps:
        res = run_cli(*args)
        assert res.returncode == 0 and "(cached)" in res.stderr, (args, res.stderr)
    assert time.perf_counter() - t0 < 60
    assert {d: (d / "manifest.json").stat().st_mtime_ns for d in (quant, packed, ver)} == mtimes
