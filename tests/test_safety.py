"""What a user's mistakes or interruptions must not do: lose a run that --force was about to replace, take a
data file for the generated task, trust a hand-edited verify verdict, or end in silence on a signal."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qerl_cli import artifact, names, tasks, train
from qerl_cli.errors import QerlError


def _finished_run(out: Path) -> artifact.Artifact:
    def body(tmp: Path) -> dict:
        (tmp / "adapter.bin").write_bytes(b"weights")
        return {}

    return artifact.run_stage(names.KIND_RUN, out, {"steps": 1}, [], body)


def test_forced_train_rerun_keeps_the_old_run_until_its_first_checkpoint(tmp_path, monkeypatch):
    out = tmp_path / "run"
    old = _finished_run(out)

    def failing(output, replaced=None, fail_after_checkpoint=False, **kw):
        assert train._prepare_output(Path(output), "new-key", False, True, replaced) == "fresh"
        Path(output).mkdir()
        (Path(output) / names.RUN_CONFIG).write_text("{}")  # the new run's first files
        if fail_after_checkpoint:
            replaced.drop()
        raise QerlError("the new run failed.")

    monkeypatch.setattr(train, "_train", failing)
    for interrupt in (False, True):  # a failure, then an interruption, before any checkpoint: the old run is back
        if interrupt:
            def interrupted(output, replaced=None, **kw):
                train._prepare_output(Path(output), "new-key", False, True, replaced)
                raise KeyboardInterrupt
            monkeypatch.setattr(train, "_train", interrupted)
        with pytest.raises((QerlError, KeyboardInterrupt)):
            train.train(output=out)
        assert artifact.open_artifact(out, names.KIND_RUN).digest == old.digest
        assert [p.name for p in tmp_path.iterdir()] == ["run"]
    monkeypatch.setattr(train, "_train", failing)
    with pytest.raises(QerlError):  # after a checkpoint the new run stands (resumable) and the old one is gone
        train.train(output=out, fail_after_checkpoint=True)
    assert (out / names.RUN_CONFIG).is_file() and not (out / names.MANIFEST).exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run"]


def test_train_refuses_a_foreign_manifest_even_with_force(tmp_path):
    out = tmp_path / "site"
    out.mkdir()
    (out / names.MANIFEST).write_text(json.dumps({"name": "pwa"}))
    with pytest.raises(QerlError, match="never replaced"):
        train._prepare_output(out, "k", False, True, train._Replaced())
    assert (out / names.MANIFEST).is_file()


def test_metrics_with_a_cut_last_line_resume_and_bad_middle_lines_are_named(tmp_path):
    m = tmp_path / "metrics.jsonl"
    m.write_text('{"step": 0, "a": 1}\n{"step": 1, "a": 2}\n{"step": 2, "a"')
    assert [r["step"] for r in train._metrics_lines(m)] == [0, 1]
    m.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(QerlError, match="line 2 is not a metrics record"):
        train._metrics_lines(m)


def test_generated_task_spec_is_exact(tmp_path):
    assert tasks.is_generated("arith") and tasks.is_generated("arith:16")
    for spec in ("arithmetic_test.jsonl", "arith.txt", "arith_set", str(tmp_path / "arith:3")):
        assert not tasks.is_generated(spec)
    with pytest.raises(QerlError, match="arith:N"):
        tasks.is_generated("arith:ten")
    f = tmp_path / "arithmetic_test.jsonl"
    f.write_text('{"question": "What is 40 + 2?", "answer": "42"}\n{"question": "What is 1 + 1?", "answer": "2"}\n')
    probs = tasks.load_problems(str(f))
    assert [p.answer for p in probs] == ["42", "2"]


def test_verify_verdict_comes_from_the_hashed_report(tmp_path):
    """A verify artifact whose manifest says passed while its report (hashed) says failed counts as failed."""
    from qerl_cli.verify import verify_passed

    def body(tmp: Path) -> dict:
        (tmp / names.VERIFY_REPORT).write_text(json.dumps({"passed": False}))
        return {"passed": True}  # what a hand edit of the manifest would say

    v = artifact.run_stage(names.KIND_VERIFY, tmp_path / "verify", {}, [], body)
    assert v.metrics["passed"] is True and verify_passed(v) is False


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_ends_with_one_line_and_its_exit_code(tmp_path, sig, code):
    """Through typer's real dispatch (a command of the real app): the interruption is reported in one line and
    the exit code is 128 + the signal, not a silent 130."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from qerl_cli import cli

        @cli.app.command("nap")
        def nap():
            os.kill(os.getpid(), {int(sig)})
            time.sleep(30)

        sys.argv = ["qerl", "nap"]
        cli.main()
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "COLUMNS": "200"})
    assert res.returncode == code, (res.returncode, res.stdout, res.stderr)
    text = (res.stdout + res.stderr).strip()
    assert "Traceback" not in text and text.startswith("interrupted:") and len(text.splitlines()) == 1, text


def _run_nap(body: str) -> subprocess.CompletedProcess:
    """``qerl nap`` through typer's real dispatch, ``body`` its command's code (indented by 4)."""
    script = "import atexit, os, sys, time\nfrom qerl_cli import cli\n\n@cli.app.command('nap')\ndef nap():\n"
    script += textwrap.indent(textwrap.dedent(body), "    ") + "\nsys.argv = ['qerl', 'nap']\ncli.main()\n"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "COLUMNS": "200"})


def test_a_second_signal_ends_at_once_with_one_line(tmp_path):
    """A second Ctrl-C after the first was handled in whatever ran then: at exit (an atexit hook, as torch's) it
    printed "Exception ignored in atexit callback" and a traceback. Any second signal now ends the process at once
    with one line and 128 + its number. One that stops a cleanup between ``_replace_dir``'s two renames leaves the
    previous output's copy, which the next run to that output puts back."""
    res = _run_nap(f"""
        atexit.register(lambda: (os.kill(os.getpid(), {int(signal.SIGINT)}), time.sleep(30)))
        os.kill(os.getpid(), {int(signal.SIGTERM)})
        time.sleep(30)
    """)
    text = (res.stdout + res.stderr).strip()
    assert res.returncode == 130 and "Traceback" not in text, (res.returncode, text)
    assert text.splitlines()[0].startswith("interrupted:") and text.splitlines()[1].startswith("interrupted again:")
    assert len(text.splitlines()) == 2, text
    out, old = tmp_path / "out", tmp_path / ".out.old-999999999-deadbeef"  # (no process has that pid)
    out.mkdir()
    (out / "kept.txt").write_text("the previous artifact")
    res = _run_nap(f"""
        try:
            os.kill(os.getpid(), {int(signal.SIGINT)})
            time.sleep(30)
        finally:  # the cleanup: _replace_dir's first rename done, then a second signal
            os.rename({str(out)!r}, {str(old)!r})
            os.kill(os.getpid(), {int(signal.SIGTERM)})
            time.sleep(30)
    """)
    text = (res.stdout + res.stderr).strip()
    assert res.returncode == 143 and text.startswith("interrupted again:") and len(text.splitlines()) == 1, text
    assert not out.exists() and old.exists()
    artifact._sweep_stale_temporaries(out)  # (what the next run_stage to this output does first)
    assert (out / "kept.txt").read_text() == "the previous artifact" and not old.exists()


def test_nan_and_inf_options_are_refused():
    from qerl_cli.engine import SamplingConfig

    for t in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="temperature must be finite"):
            SamplingConfig(temperature=t)
    # (review, session 19) a tiny temperature overflowed logits / T into NaN and crashed the sampler; a huge seed
    # overflowed the per-batch noise seed: both are one sentence now
    with pytest.raises(ValueError, match="temperature must be 0 .greedy. or at least"):
        SamplingConfig(temperature=1e-39)
    SamplingConfig(temperature=1e-4)
    from qerl_cli import calibrate, config, evaluate, rollout, verify

    # (session 28) calibrate, train and verify had no bound: a huge seed was an overflow traceback there too
    for kind, cls in (("rollout", rollout.RolloutConfig), ("evaluate", evaluate.EvaluateConfig),
                      ("calibrate", calibrate.CalibrateConfig), ("train", train.TrainConfig),
                      ("verify", verify.VerifyConfig)):
        for seed in (-1, 2**40, 20_000_000_000_000):
            with pytest.raises(QerlError, match=r"seed must be in \[0, "):
                config.load(kind, cls, None, {"seed": seed})
        config.load(kind, cls, None, {"seed": 2**40 - 1})
    with pytest.raises(QerlError, match="engine vllm draws AQN noise per batch only"):
        config.load("rollout", rollout.RolloutConfig, None, {"engine": "vllm", "noise_scope": "group", "sigma": 0.01})

    for lr in (float("nan"), float("inf"), 0.0):
        with pytest.raises(QerlError, match="lr must be finite"):
            config.load("train", train.TrainConfig, None, {"lr": lr})


def test_damaged_adapter_and_scalar_json_data_are_one_sentence(tmp_path):
    from qerl_cli import adapter, data

    a = tmp_path / "adapter"
    a.mkdir()
    (a / adapter.ADAPTER_CONFIG).write_text("{not json")
    (a / adapter.ADAPTER_WEIGHTS).write_bytes(b"\x00" * 10)
    with pytest.raises(QerlError, match="not a valid adapter config"):
        adapter.load_lora(a, None)
    (a / adapter.ADAPTER_CONFIG).write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    with pytest.raises(QerlError, match="cannot be read"):
        adapter.load_lora(a, None)
    f = tmp_path / "rows.json"
    for payload in ("5", '"hello"'):
        f.write_text(payload)
        with pytest.raises(QerlError, match="neither a JSON list"):
            data.load_records(str(f))


def test_broken_json_files_and_malformed_chat_rows_are_one_sentence(tmp_path, smollm2_tokenizer):
    """An invalid .json file, a chat row whose messages are missing, a string or lack content, and a null field
    were tracebacks (JSONDecodeError, TypeError, jinja's UndefinedError) or the text "None"."""
    from qerl_cli import data

    f = tmp_path / "rows.json"
    f.write_text('[{"text": "a"},')
    with pytest.raises(QerlError, match="is not valid JSON"):
        data.load_records(str(f))
    for row in ({"text": "x"}, {"messages": "hello"}, {"messages": []}, {"messages": [{"role": "user"}]},
                {"messages": [{"role": "user", "content": None}]}, {"messages": ["hi"]}):
        with pytest.raises(QerlError, match="non-empty 'messages' list"):
            data.row_text(row, ["messages"], smollm2_tokenizer)
    ok = {"messages": [{"role": "user", "content": "2+2?"}]}
    assert "2+2?" in data.row_text(ok, ["messages"], smollm2_tokenizer)
    with pytest.raises(QerlError, match="field 'prompt' is null"):
        data.row_text({"prompt": None}, ["prompt"])


def test_stop_after_below_one_and_null_fields_are_refused(tmp_path):
    with pytest.raises(QerlError, match="--stop-after must be at least 1"):
        train.train("unused-model", tmp_path / "run", stop_after=0)
    assert not (tmp_path / "run").exists()
    with pytest.raises(QerlError, match="null"):
        tasks.problems_from_rows([{"question": None, "answer": "1"}])


def test_prompt_stream_takes_in_epoch_slices_with_the_same_order(tmp_path):
    """take(k) equals k single takes (the seeded order per epoch, reshuffled each epoch), and a take far larger
    than the problem set costs one shuffle per epoch, not one per prompt (it used to hang)."""
    a, b = train.PromptStream(7, 3), train.PromptStream(7, 3)
    bulk = a.take(23)
    assert bulk == [a._order(i // 7)[i % 7] for i in range(23)] and a.cursor == 23  # the definition
    assert [b.take(1)[0] for _ in range(10)] + b.take(13) == bulk and b.cursor == 23
    assert sorted(bulk[:7]) == list(range(7)) and bulk[:7] != bulk[7:14]  # every epoch a permutation, reshuffled
    assert len(train.PromptStream(4, 0).take(200_000)) == 200_000


def test_a_diverged_adapter_stops_the_run_with_one_sentence():
    train.check_diverged(3.5, 4, 1e-3)
    for bad in (float("nan"), float("inf")):
        with pytest.raises(QerlError, match="training diverged at step 4"):
            train.check_diverged(bad, 4, 1e30)


@pytest.mark.parametrize("suffix,payload", [
    (".jsonl", '{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n'),
    (".json", '[{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]'),
    (".txt", "first passage\n\nsecond passage\n"),
])
def test_utf8_files_with_a_byte_order_mark_read_like_without(tmp_path, suffix, payload):
    """Editors on Windows save UTF-8 with a BOM; the rows (and the first row's first key) are the same."""
    from qerl_cli import data

    plain, bom = tmp_path / f"plain{suffix}", tmp_path / f"bom{suffix}"
    plain.write_text(payload, encoding="utf-8")
    bom.write_text(payload, encoding="utf-8-sig")
    assert bom.read_bytes().startswith(b"\xef\xbb\xbf")
    assert data.load_records(str(bom)).rows == data.load_records(str(plain)).rows
    assert len(data.load_records(str(bom)).rows) == 2


def test_a_run_config_that_is_not_an_object_is_one_sentence_on_resume(tmp_path):
    """A train_config.json holding a JSON list was an AttributeError traceback with --resume."""
    out = tmp_path / "run"
    out.mkdir()
    (out / names.RUN_CONFIG).write_text("[1, 2]\n")
    with pytest.raises(QerlError, match="train_config.json is not a readable run config, so it cannot be resumed"):
        train._prepare_output(out, "sha256:" + "0" * 64, resume=True, force=False)
