"""The real ``qerl`` command in a subprocess (src/qerl_cli/cli.py): help, clean errors, cache, --force, exit codes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from conftest import build_tiny_llama, run_cli


def _assert_clean_error(res: subprocess.CompletedProcess, out: Path | None = None, match: str = "") -> str:
    assert res.returncode == 1, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    lines = [l for l in res.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, res.stderr
    line = lines[0]
    assert line.startswith("error: ") and line.rstrip().endswith("."), line
    assert match in line, line
    if out is not None:
        assert not out.exists()
        assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    return line


@pytest.fixture()
def pipeline_copy(tiny_pipeline, tmp_path) -> dict[str, Path]:
    """A private copy of the session's quant/packed/verify dirs (relative input paths preserved)."""
    root = tmp_path / "run"
    root.mkdir()
    for k in ("quant", "packed", "verify"):
        shutil.copytree(tiny_pipeline[k], root / k)
    return {"model": tiny_pipeline["model"], **{k: root / k for k in ("quant", "packed", "verify")}}


def test_help_lists_stages():
    res = run_cli("--help")
    assert res.returncode == 0, res.stderr
    for stage in ("quantize", "pack", "verify"):
        assert stage in res.stdout
    for stage in ("quantize", "pack", "verify"):
        sub = run_cli(stage, "--help")
        assert sub.returncode == 0 and "--output" in sub.stdout and "--force" in sub.stdout and "--config" in sub.stdout
        assert f"qerl {stage}" in sub.stdout  # a runnable example


def test_missing_model_path(tmp_path):
    out = tmp_path / "quant"
    _assert_clean_error(run_cli("quantize", str(tmp_path / "no-such-model"), "-o", str(out)), out, "does not exist")


def test_wrong_artifact_kind(pipeline_copy, tmp_path):
    out = tmp_path / "verify"
    line = _assert_clean_error(run_cli("verify", str(pipeline_copy["quant"]), "-o", str(out)), out)
    assert "'quant' artifact" in line and "'packed'" in line


def test_truncated_safetensors(pipeline_copy, tmp_path):
    f = pipeline_copy["quant"] / "model.safetensors"
    size = f.stat().st_size
    with open(f, "r+b") as fh:
        fh.truncate(size // 2)
    out = tmp_path / "packed"
    line = _assert_clean_error(run_cli("pack", str(pipeline_copy["quant"]), "-o", str(out)), out, "model.safetensors")
    assert "damaged" in line and "--force" in line


def test_k_not_multiple_of_16(smollm2_tokenizer, tmp_path):
    model = build_tiny_llama(tmp_path / "odd", smollm2_tokenizer, hidden=40, heads=4, kv_heads=2, layers=1)
    out = tmp_path / "quant"
    line = _assert_clean_error(run_cli("quantize", str(model), "-o", str(out)), out, "not a multiple of 16")
    assert "40 input features" in line


def test_nan_weights(smollm2_tokenizer, tmp_path):
    model = build_tiny_llama(tmp_path / "nan", smollm2_tokenizer, layers=1)
    f = model / "model.safetensors"
    t = load_file(str(f))
    t["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(t, str(f), metadata={"format": "pt"})
    out = tmp_path / "quant"
    _assert_clean_error(run_cli("quantize", str(model), "-o", str(out)), out, "NaN")


def test_model_path_with_brackets_is_reported_verbatim(tmp_path):
    """A path is data, not rich markup: '[/]' must neither crash the error printer nor vanish from the message."""
    bad = tmp_path / "runs[/]x"
    out = tmp_path / "quant"
    line = _assert_clean_error(run_cli("quantize", str(bad), "-o", str(out)), out)
    assert str(bad) in line
    bad2 = tmp_path / "runs[bold]y"
    line = _assert_clean_error(run_cli("quantize", str(bad2), "-o", str(out)), out)
    assert str(bad2) in line


def test_long_error_is_one_line_when_piped(tmp_path):
    """stderr piped to a file or a Makefile log has no terminal width: the sentence must not be wrapped."""
    deep = tmp_path / ("a-rather-long-directory-name-" * 3) / "no-such-model"
    out = tmp_path / "quant"
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    res = subprocess.run([sys.executable, "-m", "qerl_cli.cli", "quantize", str(deep), "-o", str(out)],
                         capture_output=True, text=True, env=env, timeout=300)
    line = _assert_clean_error(res, out)
    assert str(deep) in line


def test_rerun_is_cached_and_force_rewrites(pipeline_copy):
    """The CLI and the Python API compute the same key (progress is cosmetic): the copied artifacts are cached."""
    quant, packed = pipeline_copy["quant"], pipeline_copy["packed"]
    mf = quant / "manifest.json"
    before = mf.stat().st_mtime_ns
    created = json.loads(mf.read_text())["created"]
    res = run_cli("quantize", str(pipeline_copy["model"]), "-o", str(quant), "--no-progress")
    assert res.returncode == 0, res.stderr
    assert "(cached)" in res.stderr
    assert mf.stat().st_mtime_ns == before
    res = run_cli("pack", str(quant), "-o", str(packed))
    assert res.returncode == 0 and "(cached)" in res.stderr
    # a different artifact at the output is refused without --force
    res = run_cli("pack", str(quant), "-o", str(pipeline_copy["verify"]))
    _assert_clean_error(res, None, "--force")
    assert (pipeline_copy["verify"] / "report.json").is_file()
    # --force recomputes
    res = run_cli("quantize", str(pipeline_copy["model"]), "-o", str(quant), "--force")
    assert res.returncode == 0, res.stderr
    assert "(cached)" not in res.stderr
    assert mf.stat().st_mtime_ns != before
    m = json.loads(mf.read_text())
    assert m["created"] >= created
    assert not [p for p in quant.parent.iterdir() if p.name.startswith(".")]


def test_verify_failure_exits_1(pipeline_copy, tmp_path, monkeypatch):
    from qerl_cli import names
    from qerl_cli import pack as pack_mod

    real = pack_mod.pack_tensors

    def bad(tensors, progress=True):
        out, index = real(tensors, progress)
        k = sorted(n for n in out if n.endswith(names.PK_GLOBAL))[0]
        out[k] = out[k] * 1.01
        return out, index

    monkeypatch.setattr(pack_mod, "pack_tensors", bad)
    pack_mod.pack(pipeline_copy["quant"], tmp_path / "bad-packed", progress=False)
    monkeypatch.undo()
    out = tmp_path / "verify"
    res = run_cli("verify", str(tmp_path / "bad-packed"), "-o", str(out))
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr
    assert "FAILED" in res.stdout and "PASSED" not in res.stdout
    # the report is written either way, and says which check failed
    report = json.loads((out / "report.json").read_text())
    assert report["passed"] is False and report["checks"]["3_round_trip"]["passed"] is False
    # rerunning the failed verify is cached and still exits 1
    res = run_cli("verify", str(tmp_path / "bad-packed"), "-o", str(out))
    assert res.returncode == 1 and "(cached)" in res.stderr


def test_output_that_cannot_be_created_is_one_sentence(pipeline_copy):
    res = run_cli("pack", str(pipeline_copy["quant"]), "-o", "/proc/qerl-cannot-be-here", "--no-progress")
    _assert_clean_error(res)


@pytest.mark.parametrize("flags,want", [([], False), (["--progress"], True), (["--no-progress"], False)])
def test_config_file_progress_is_not_overridden_by_the_flag_default(tmp_path, monkeypatch, flags, want):
    """`progress = false` in a --config file (stages/*.toml documents it) took no effect: the CLI always passed
    progress=True. Only an explicit --progress/--no-progress overrides the file."""
    from qerl_cli import cli, config

    real, seen = config.load, {}

    def load(stage, cls, config_file=None, overrides=None):
        seen["progress"] = real(stage, cls, config_file, overrides).progress
        raise cli.QerlError("stopped after the config.")

    monkeypatch.setattr(config, "load", load)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)  # (pytest's own handlers stay)
    cfg = tmp_path / "pack.toml"
    cfg.write_text("progress = false\n")
    monkeypatch.setattr(sys, "argv", ["qerl", "pack", str(tmp_path / "quant"), "-o", str(tmp_path / "p"),
                                      "--config", str(cfg), *flags])
    with pytest.raises(SystemExit) as e:
        cli.main()
    assert e.value.code == 1 and seen == {"progress": want}


@pytest.mark.parametrize("error,where", [("gpu", "GPU"), ("cpu", "host"), ("memory", "host"), ("other", None)])
def test_out_of_memory_is_one_sentence(pipeline_copy, tmp_path, monkeypatch, capsys, error, where):
    """Out of memory inside a stage (torch's CUDA error, its CPU allocator's message, Python's MemoryError): one
    sentence and exit 1, the output not written; any other RuntimeError is not taken for one."""
    import torch

    from qerl_cli import cli, pack

    def fail(*a, **k):
        raise {"gpu": torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
               "cpu": RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
               "memory": MemoryError(), "other": RuntimeError("shapes disagree")}[error]

    monkeypatch.setattr(pack, "pack_tensors", fail)
    monkeypatch.setattr(cli.signal, "signal", lambda *a: None)
    out = tmp_path / "p"
    monkeypatch.setattr(sys, "argv", ["qerl", "pack", str(pipeline_copy["quant"]), "-o", str(out), "--no-progress"])
    if where is None:
        with pytest.raises(RuntimeError, match="shapes disagree"):
            cli.main()
        return
    with pytest.raises(SystemExit) as e:
        cli.main()
    captured = capsys.readouterr()
    text = " ".join((captured.out + captured.err).split())
    assert e.value.code == 1 and f"error: out of {where} memory;" in text and not out.exists()
