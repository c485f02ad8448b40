"""The artifact contract (DESIGN §2, src/qerl_cli/artifact.py): manifest, cache, atomic writes, checks on read."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qerl_cli import __version__, artifact, names
from qerl_cli.errors import QerlError

MANIFEST_FIELDS = {"schema", "kind", "qerl_version", "created", "config", "inputs", "files", "key", "digest",
                   "metrics"}
SHA = re.compile(r"^[0-9a-f]{64}$")
TAGGED = re.compile(r"^sha256:[0-9a-f]{64}$")  # key, digest and input digests name their algorithm


class Body:
    """A stage body that writes two files and counts its calls."""

    def __init__(self, text: str = "hello", fail: bool = False):
        self.calls = 0
        self.text = text
        self.fail = fail

    def __call__(self, tmp: Path) -> dict:
        self.calls += 1
        (tmp / "payload.txt").write_text(self.text)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "data.bin").write_bytes(b"\x00\x01\x02")
        if self.fail:
            raise RuntimeError("boom")
        return {"extra_metric": 3}


CFG = {"alpha": 1, "progress": True}
INPUTS = [artifact.Input("model", "some/model", "a" * 64)]


def _run(out: Path, body=None, config=None, inputs=None, kind="quant", force=False):
    return artifact.run_stage(kind, out, CFG if config is None else config, INPUTS if inputs is None else inputs,
                              body or Body(), force=force)


def _siblings(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.iterdir() if p.name != out.name)


def _rewrite_manifest(out: Path, **changes) -> None:
    mf = out / names.MANIFEST
    m = json.loads(mf.read_text())
    m.update(changes)
    mf.write_text(json.dumps(m))


# ------------------------------------------------------------------------------------------- manifest


def test_manifest_fields_as_designed(tmp_path):
    out = tmp_path / "art"
    art = _run(out)
    m = json.loads((out / names.MANIFEST).read_text())
    assert set(m) == MANIFEST_FIELDS
    assert m["schema"] == "qerl.artifact/1"
    assert m["kind"] == "quant"
    assert m["qerl_version"] == __version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", m["created"])
    assert m["config"] == CFG
    assert m["inputs"] == [{"kind": "model", "path": "some/model", "digest": "sha256:" + "a" * 64}]
    assert sorted(f["path"] for f in m["files"]) == ["payload.txt", "sub/data.bin"]
    for f in m["files"]:
        assert set(f) == {"path", "sha256", "bytes"} and SHA.match(f["sha256"])
        assert f["bytes"] == (out / f["path"]).stat().st_size
        assert f["sha256"] == artifact.sha256_file(out / f["path"])
    assert TAGGED.match(m["key"]) and TAGGED.match(m["digest"]) and m["key"] != m["digest"]
    assert m["key"] == artifact.cache_key("quant", CFG, INPUTS)
    assert {"wall_s", "peak_rss_bytes", "peak_cuda_bytes"} <= set(m["metrics"])
    assert m["metrics"]["peak_rss_bytes"] > 10 * 2**20  # bytes, not KiB
    assert m["metrics"]["extra_metric"] == 3
    assert art.digest == m["digest"] and art.kind == "quant" and art.path == out
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json", "payload.txt", "sub"]


def test_digest_covers_file_hashes(tmp_path):
    a = _run(tmp_path / "a", Body("one"))
    b = _run(tmp_path / "b", Body("two"))
    assert a.key == b.key and a.digest != b.digest


def test_as_input_is_relative_to_the_consumer(tmp_path):
    a = _run(tmp_path / "quant")
    i = a.as_input(tmp_path / "packed")
    assert i.path == "../quant" and i.kind == "quant" and i.digest == a.digest


# ---------------------------------------------------------------------------------------------- cache


def test_cache_hit_does_not_call_body(tmp_path, capsys):
    out = tmp_path / "art"
    body = Body()
    first = _run(out, body)
    mtime = (out / names.MANIFEST).stat().st_mtime_ns
    again = _run(out, body)
    assert body.calls == 1
    assert again.digest == first.digest
    assert (out / names.MANIFEST).stat().st_mtime_ns == mtime
    assert "cached" in capsys.readouterr().err


def test_cache_hit_after_output_files_deleted_is_an_error_not_a_silent_hit(tmp_path):
    out = tmp_path / "art"
    body = Body()
    _run(out, body)
    (out / "payload.txt").unlink()
    with pytest.raises(QerlError, match="--force"):
        _run(out, body)
    assert body.calls == 1
    _run(out, body, force=True)
    assert body.calls == 2 and (out / "payload.txt").is_file()


def test_force_recomputes(tmp_path):
    out = tmp_path / "art"
    body = Body()
    first = _run(out, body)
    second = _run(out, body, force=True)
    assert body.calls == 2
    assert second.manifest["created"] >= first.manifest["created"]
    assert _siblings(out) == []  # neither the temp dir nor the old copy is left behind


def test_cosmetic_fields_do_not_change_the_key(tmp_path):
    out = tmp_path / "art"
    body = Body()
    _run(out, body, config={"alpha": 1, "progress": True})
    _run(out, body, config={"alpha": 1, "progress": False})
    assert body.calls == 1
    k = artifact.cache_key
    assert k("quant", {"alpha": 1, "progress": True}, INPUTS) == k("quant", {"alpha": 1, "progress": False}, INPUTS)


def test_key_includes_real_config_inputs_and_stage():
    k = artifact.cache_key
    base = k("quant", {"alpha": 1}, INPUTS)
    assert k("quant", {"alpha": 2}, INPUTS) != base
    assert k("quant", {"alpha": 1, "beta": 0}, INPUTS) != base
    assert k("quant", {"alpha": 1}, [artifact.Input("model", "some/model", "b" * 64)]) != base
    assert k("quant", {"alpha": 1}, []) != base
    assert k("packed", {"alpha": 1}, INPUTS) != base
    # the input's path is where it was found, not what it is
    assert k("quant", {"alpha": 1}, [artifact.Input("model", "elsewhere", "a" * 64)]) == base


def test_changed_config_at_same_output_is_not_silently_overwritten(tmp_path):
    out = tmp_path / "art"
    body = Body()
    _run(out, body)
    with pytest.raises(QerlError, match="different 'quant' artifact"):
        _run(out, body, config={"alpha": 2, "progress": True})
    assert body.calls == 1
    _run(out, body, config={"alpha": 2, "progress": True}, force=True)
    assert body.calls == 2
    assert json.loads((out / names.MANIFEST).read_text())["config"]["alpha"] == 2


def test_different_kind_at_output_path(tmp_path):
    out = tmp_path / "art"
    _run(out, kind="calib")
    body = Body()
    with pytest.raises(QerlError, match="different 'calib' artifact"):
        _run(out, body)
    assert body.calls == 0


def test_non_artifact_directory_is_never_replaced(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    body = Body()
    for force in (False, True):
        with pytest.raises(QerlError, match="not a qerl artifact"):
            _run(out, body, force=force)
    assert body.calls == 0 and (out / "thesis.tex").read_text() == "precious"


def test_empty_directory_and_file_at_output(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    _run(out)
    assert (out / names.MANIFEST).is_file()
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(QerlError, match="not a directory"):
        _run(f)


# --------------------------------------------------------------------------------------------- atomic


def test_failing_body_leaves_nothing(tmp_path):
    out = tmp_path / "art"
    with pytest.raises(RuntimeError, match="boom"):
        _run(out, Body(fail=True))
    assert not out.exists()
    assert _siblings(out) == []


def test_failing_forced_rerun_keeps_the_old_artifact(tmp_path):
    out = tmp_path / "art"
    good = _run(out, Body("good"))
    with pytest.raises(RuntimeError):
        _run(out, Body("bad", fail=True), force=True)
    assert (out / "payload.txt").read_text() == "good"
    assert artifact.open_artifact(out, "quant").digest == good.digest
    assert _siblings(out) == []


def test_keyboard_interrupt_leaves_nothing(tmp_path):
    out = tmp_path / "art"

    def body(tmp):
        (tmp / "half.bin").write_bytes(b"x" * 10)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(out, body)
    assert not out.exists() and _siblings(out) == []


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temporary_of_dead_process_is_swept(tmp_path):
    out = tmp_path / "art"
    stale = tmp_path / f".art.tmp-{_dead_pid()}-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    other = tmp_path / ".other.tmp-1-deadbeef"  # another output's temporary: not ours to sweep
    other.mkdir()
    _run(out)
    assert not stale.exists()
    assert other.exists()
    assert (out / names.MANIFEST).is_file()


def test_output_stranded_by_a_kill_between_the_renames_is_restored(tmp_path):
    """(review, session 26) A stage killed outright (SIGKILL) between _replace_dir's two renames leaves the
    previous artifact as .art.old-PID-*; the next run put it back only if nothing swept it first: the sweep
    deleted it. Now it goes back to art (and the same command is then a cache hit); where art exists, the
    replaced output was only not yet removed, and goes."""
    out = tmp_path / "art"
    first = _run(out)
    pid = _dead_pid()
    os.rename(out, tmp_path / f".art.old-{pid}-deadbeef")
    half = tmp_path / f".art.tmp-{pid}-cafecafe"
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"half")
    body = Body()
    again = _run(out, body)
    assert body.calls == 0 and again.digest == first.digest  # restored, then a cache hit
    assert _siblings(out) == []
    leftover = tmp_path / f".art.old-{_dead_pid()}-feedface"
    leftover.mkdir()
    _run(out)
    assert not leftover.exists() and (out / names.MANIFEST).is_file()


def test_sweep_reads_output_names_literally(tmp_path):
    """(review, session 31) The sweep's patterns were globs built from the output's name: a stage writing "v[12]"
    matched v1's stranded ".v1.old-*" and deleted the artifact that v1's next run would have restored."""
    v1 = tmp_path / "v1"
    first = _run(v1)
    os.rename(v1, tmp_path / f".v1.old-{_dead_pid()}-deadbeef")
    _run(tmp_path / "v[12]")
    assert (tmp_path / "v[12]" / names.MANIFEST).is_file()
    body = Body()
    assert _run(v1, body).digest == first.digest and body.calls == 0  # v1's own run restored it


def test_temporary_of_live_process_is_kept(tmp_path):
    out = tmp_path / "art"
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tmp = tmp_path / f".art.tmp-{live.pid}-cafecafe"
        tmp.mkdir()
        _run(out)
        assert tmp.exists()
    finally:
        live.kill()
        live.wait()


# ------------------------------------------------------------------------------------------- reading


@pytest.fixture()
def art_dir(tmp_path) -> Path:
    out = tmp_path / "art"
    _run(out)
    return out


def test_open_ok(art_dir):
    a = artifact.open_artifact(art_dir, "quant")
    assert a.kind == "quant" and a.config == CFG and a.file("payload.txt").read_text() == "hello"
    assert artifact.open_artifact(art_dir, ("calib", "quant")).kind == "quant"


def test_wrong_kind(art_dir):
    with pytest.raises(QerlError, match=r"is a 'quant' artifact, but a 'packed' artifact is needed"):
        artifact.open_artifact(art_dir, "packed")
    with pytest.raises(QerlError, match=r"is a 'quant' artifact, but an 'eval' or 'run' artifact is needed"):
        artifact.open_artifact(art_dir, ("eval", "run"))


@pytest.mark.parametrize("schema,match", [("qerl.artifact/2", "schema qerl.artifact/2"),
                                          ("qerl.artifact/x", "unknown manifest schema"),
                                          ("something/1", "unknown manifest schema"),
                                          ("", "unknown manifest schema")])
def test_unknown_schema(art_dir, schema, match):
    _rewrite_manifest(art_dir, schema=schema)
    with pytest.raises(QerlError, match=match):
        artifact.open_artifact(art_dir, "quant")


def test_tampered_file(art_dir):
    (art_dir / "payload.txt").write_text("HELLO")  # same size, different bytes
    with pytest.raises(QerlError, match=r"damaged: file 'payload.txt' does not match its sha256"):
        artifact.open_artifact(art_dir, "quant")
    # without the check the manifest still opens
    assert artifact.open_artifact(art_dir, "quant", check_files=False).kind == "quant"


def test_truncated_file(art_dir):
    (art_dir / "sub" / "data.bin").write_bytes(b"\x00")
    with pytest.raises(QerlError, match=r"'sub/data.bin' has 1 bytes, the manifest says 3"):
        artifact.open_artifact(art_dir, "quant")


def test_missing_file(art_dir):
    (art_dir / "payload.txt").unlink()
    with pytest.raises(QerlError, match=r"file 'payload.txt' is missing"):
        artifact.open_artifact(art_dir, "quant")


def test_tampered_digest(art_dir):
    _rewrite_manifest(art_dir, digest="sha256:" + "0" * 64)
    with pytest.raises(QerlError, match="digest"):
        artifact.open_artifact(art_dir, "quant")


@pytest.mark.parametrize("bad", ["../outside.txt", "/etc/passwd", "sub/../../x", "a\\..\\b", ""])
def test_manifest_paths_must_stay_inside(art_dir, bad):
    m = json.loads((art_dir / names.MANIFEST).read_text())
    m["files"].append({"path": bad, "sha256": "0" * 64, "bytes": 0})
    (art_dir / names.MANIFEST).write_text(json.dumps(m))
    with pytest.raises(QerlError, match="outside the artifact"):
        artifact.open_artifact(art_dir, "quant")
    a = artifact.open_artifact(art_dir, "quant", check_files=False)
    with pytest.raises(QerlError, match="outside the artifact"):
        a.file(bad)


@pytest.mark.parametrize("content,match", [("not json", "not valid JSON"), ("[1, 2]", "JSON object"),
                                           ('{"schema": "qerl.artifact/1", "kind": "quant"}', "lacks the required")])
def test_broken_manifest(art_dir, content, match):
    (art_dir / names.MANIFEST).write_text(content)
    with pytest.raises(QerlError, match=match):
        artifact.open_artifact(art_dir, "quant")


def test_not_an_artifact(tmp_path):
    with pytest.raises(QerlError, match="does not exist"):
        artifact.open_artifact(tmp_path / "nope", "quant")
    (tmp_path / "plain").mkdir()
    with pytest.raises(QerlError, match="no manifest.json"):
        artifact.open_artifact(tmp_path / "plain", "quant")
    (tmp_path / "f").write_text("x")
    with pytest.raises(QerlError, match="not a directory"):
        artifact.open_artifact(tmp_path / "f", "quant")


def test_symlink_in_output_rejected(tmp_path):
    def body(tmp):
        (tmp / "real.txt").write_text("x")
        (tmp / "link.txt").symlink_to(tmp / "real.txt")

    out = tmp_path / "art"
    with pytest.raises(QerlError, match="symbolic link"):
        _run(out, body)
    assert not out.exists() and _siblings(out) == []


def test_names_are_constants():
    assert names.MANIFEST == "manifest.json" and names.SCHEMA == "qerl.artifact/1"
    assert {"progress"} <= names.COSMETIC_FIELDS


def test_directory_with_a_foreign_manifest_is_never_replaced(tmp_path):
    """A web app's manifest.json is not a qerl artifact: refused with and without --force, files untouched (a
    qerl manifest this qerl cannot read, e.g. an older schema, can still be replaced with --force)."""
    out = tmp_path / "webapp"
    out.mkdir()
    (out / names.MANIFEST).write_text(json.dumps({"name": "my-pwa"}))
    (out / "index.html").write_text("precious")
    body = Body()
    for force in (False, True):
        with pytest.raises(QerlError, match="not a qerl artifact's; it is never replaced"):
            _run(out, body, force=force)
    assert body.calls == 0 and (out / "index.html").read_text() == "precious"
    old = tmp_path / "old"
    _run(old)
    _rewrite_manifest(old, schema=names.SCHEMA_NAME + "/0")
    with pytest.raises(QerlError, match="already holds an unreadable artifact"):
        _run(old)
    assert _run(old, force=True).manifest[names.K_SCHEMA] == names.SCHEMA


def test_output_overlapping_an_input_is_refused(tmp_path):
    """Writing a stage's output onto its input, into it, or around it would destroy the input: refused before
    anything runs, --force or not."""
    src = _run(tmp_path / "src")
    data = tmp_path / "data.jsonl"
    data.write_text("{}\n")
    body = Body()
    for out, inp in ((src.path, src.as_input(src.path)), (src.path / "inner", src.as_input(src.path / "inner")),
                     (tmp_path, src.as_input(tmp_path)), (tmp_path, artifact.Input("data", str(data), "b" * 64))):
        for force in (False, True):
            with pytest.raises(QerlError, match="overlap"):
                _run(out, body, inputs=[inp], force=force)
    assert body.calls == 0 and artifact.open_artifact(src.path, "quant").digest == src.digest
    ok = _run(tmp_path / "next", inputs=[src.as_input(tmp_path / "next"), artifact.Input("task", "arith:4", "c" * 64)])
    assert ok.path.is_dir()


@pytest.mark.parametrize("change", [{"files": ["payload.txt"]}, {"files": {"a": 1}}, {"files": None},
                                    {"key": 5}, {"inputs": ["x"]}, {"metrics": None}, {"kind": ["quant"]},
                                    # (review, session 31: verify read inputs[0]["path"] with a KeyError traceback)
                                    {"inputs": [{"kind": "quant", "digest": "sha256:" + "0" * 64}]},
                                    {"inputs": [{"kind": "quant", "path": 3, "digest": "sha256:" + "0" * 64}]}])
def test_manifest_fields_of_the_wrong_type_are_one_sentence(tmp_path, change):
    out = tmp_path / "art"
    _run(out)
    _rewrite_manifest(out, **change)
    with pytest.raises(QerlError, match="wrong type|unknown|lacks"):
        artifact.open_artifact(out, "quant")
    assert _run(out, force=True).manifest[names.K_KIND] == "quant"  # still ours: --force replaces it


def test_an_output_inside_another_artifact_is_refused(tmp_path):
    """(review, session 34) `qerl pack quant -o eval/p` wrote a pack inside an eval artifact; replacing the eval
    (--force) then deleted it. An output that lies inside an artifact, or inside a train run's directory, is now
    refused before anything is written."""
    def body(tmp: Path) -> dict:
        (tmp / "x.txt").write_text("x")
        return {}

    outer = artifact.run_stage("eval", tmp_path / "eval", {"a": 1}, [], body)
    for inside in (outer.path / "p", outer.path / "deeper" / "p"):
        with pytest.raises(QerlError, match=r"lies inside the artifact .*eval, which would lose it when replaced"):
            artifact.run_stage("packed", inside, {"a": 1}, [], body)
        assert not inside.exists()
    run = tmp_path / "run"  # (a train run's directory holds train_config.json from its start, before a manifest)
    run.mkdir()
    (run / names.RUN_CONFIG).write_text(json.dumps({"key": "sha256:" + "0" * 64, "definitions": {}}))
    with pytest.raises(QerlError, match="lies inside the artifact"):
        artifact.run_stage("eval", run / "eval", {"a": 1}, [], body)
    # a folder that is no artifact holds outputs as before, with another tool's train_config.json or manifest.json
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / names.RUN_CONFIG).write_text('{"lr": 0.001}')
    (plain / names.MANIFEST).write_text('{"name": "a web app"}')
    assert artifact.run_stage("eval", plain / "e", {"a": 1}, [], body).path.is_dir()


def test_force_over_a_linked_output_leaves_no_hidden_copy(tmp_path):
    """(review, session 34) An output that was a symbolic link to an artifact: --force replaced the link with the
    new artifact but left the old link behind as a hidden `.NAME.old-*` entry (rmtree refuses links)."""
    def body(tmp: Path) -> dict:
        (tmp / "x.txt").write_text("new")
        return {}

    target = artifact.run_stage("eval", tmp_path / "eval", {"a": 1}, [], body)
    (tmp_path / "lnk").symlink_to(target.path)
    new = artifact.run_stage("eval", tmp_path / "lnk", {"a": 2}, [], body, force=True)
    assert not new.path.is_symlink() and new.config == {"a": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "lnk"]
    assert artifact.open_artifact(tmp_path / "eval", "eval").config == {"a": 1}  # (the linked artifact stays)


def test_a_linked_output_left_by_a_killed_stage_is_swept(tmp_path):
    """(review, session 34) A stage killed after replacing a linked output left its old link as `.NAME.old-*`:
    the sweep's rmtree refused links (and a dangling one crashed its sort)."""
    target = tmp_path / "target"
    target.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    for name, to in ((".out.old-999999999-deadbeef", target), (".out.old-999999998-deadbeef", tmp_path / "gone")):
        (tmp_path / name).symlink_to(to)
    artifact._sweep_stale_temporaries(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "target"]
