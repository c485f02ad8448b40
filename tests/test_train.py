"""train: LoRA through peft on the packed model, the GRPO loop, the run directory, resume, data parallel, CLI.

A tiny random model never answers an arithmetic question, so the loop tests score completions with a
stand-in reward (first generated token id even -> 1) that gives informative groups; the real scorer is
used by the CLI test on SmolLM2.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import REPO, run_cli
from qerl_cli import artifact, lora, names, rollout, stats, tasks, train
from qerl_cli.adapter import load_lora
from qerl_cli.engine import Engine
from qerl_cli.errors import QerlError

TINY = dict(task="arith:16", steps=4, prompts_per_step=2, group=4, max_new_tokens=6, lr=5e-3, save_every=2,
            sigma_stages=3, sigma_start=0.05, sigma_end=0.01, progress=False)
OVR = {"dynamic_sampling": False, "lora_rank": 4, "lora_alpha": 8.0, "batch_prompts": 1}

DIAGNOSTIC_KEYS = {
    "step", "sigma", "lr", "reward_mean", "reward_std", "accuracy", "informative_fraction", "response_length_mean",
    "truncation_rate", "parse_failure_rate", "entropy", "ratio_min", "ratio_mean", "ratio_max", "clip_frac_low",
    "clip_frac_high", "logprob_gap_abs", "grad_norm", "time_rollout_s", "time_logprobs_s", "time_backward_s",
    "time_optimizer_s", "time_sync_s", "peak_mem_allocated_bytes", "peak_mem_reserved_bytes", "tokens_per_s"}

REWARD_PATCH = '''
def _fake_score(batch, tok, problems, format_reward):
    rows = []
    for r in range(batch.rows):
        first = int(batch.completion_ids[r, 0])
        ok = first % 2 == 0
        rows.append({"prompt": r // batch.group, "sample": r % batch.group, "completion": "",
                     "finish_reason": batch.finish_reason[r], "tokens": int(batch.completion_mask[r].sum()),
                     "status": "correct" if ok else "wrong", "reward": 1.0 if ok else 0.0})
    return rows
'''
_ns: dict = {}
exec(REWARD_PATCH, _ns)
fake_score = _ns["_fake_score"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared machine: extra intra-op threads only add contention (10x slower here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def reward(monkeypatch):
    monkeypatch.setattr(rollout, "score_batch", fake_score)


def _metrics(run) -> list[dict]:
    return [json.loads(x) for x in (run / names.RUN_METRICS).read_text().splitlines()]


def _deterministic(ms: list[dict]) -> list[dict]:
    return [{k: v for k, v in m.items() if not k.startswith(train.NONDETERMINISTIC_METRICS)} for m in ms]


def _resolved(tiny_pipeline) -> dict:
    """A resolved TrainConfig as a dict (the shipped defaults with TINY's values)."""
    from qerl_cli import config

    return config.as_dict(config.load("train", train.TrainConfig, None, {k: v for k, v in TINY.items()}))


def _with(cfg, **kw):
    import dataclasses

    return dataclasses.replace(cfg, **kw)


def _adapter(d) -> dict[str, torch.Tensor]:
    return load_file(str(d / names.ADAPTER_WEIGHTS))


def test_training_steps_change_loss_and_adapter(tiny_pipeline, tmp_path, reward):
    run = tmp_path / "run"
    art = train.train(tiny_pipeline["packed"], run, **TINY, overrides=OVR)
    assert art.kind == names.KIND_RUN
    step_files = {names.ADAPTER_CONFIG, names.ADAPTER_WEIGHTS, names.OPTIMIZER_STATE, names.RNG_STATE,
                  names.TRAINER_STATE, names.STEP_HASHES}
    assert sorted(f["path"] for f in art.manifest["files"]) == sorted(
        [names.RUN_CONFIG, names.RUN_METRICS] + [f"step-0000000{s}/{f}" for s in (2, 4) for f in step_files])
    assert sorted(p.name for p in run.iterdir()) == sorted([names.MANIFEST, names.RUN_CONFIG, names.RUN_METRICS,
                                                            "step-00000002", "step-00000004"])
    ms = _metrics(run)
    assert [m["step"] for m in ms] == [1, 2, 3, 4]
    assert DIAGNOSTIC_KEYS <= set(ms[0])
    assert [m["sigma"] for m in ms] == [0.0, 0.0, pytest.approx(0.05), pytest.approx(0.01)]
    assert any(m["loss"] != 0 for m in ms) and any(m["informative_fraction"] > 0 for m in ms)
    assert ms[0]["adapter_norm"] != ms[-1]["adapter_norm"]
    a2, a4 = _adapter(run / "step-00000002"), _adapter(run / "step-00000004")
    assert a2.keys() == a4.keys() and len(a2) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    assert any(not torch.equal(a2[k], a4[k]) for k in a2)
    assert any(k.endswith("lora_B.weight") and a4[k].abs().max() > 0 for k in a4)  # B left its zero init
    rc = json.loads((run / names.RUN_CONFIG).read_text())
    assert rc["config"]["objective"] == "clean" and rc["config"]["skip_verify"] is False
    assert rc["policy"]["weights"] == "nvfp4-packed" and len(rc["sigma_schedule"]) == 4
    assert "behaviour" in rc["definitions"]["behaviour_logprobs"]
    assert rc["config"]["verifier"] == tasks.verifier() and art.config["verifier"]["reward"] == tasks.REWARD_FUNCTION
    # same command again: a cache hit
    again = train.train(tiny_pipeline["packed"], run, **TINY, overrides=OVR)
    assert again.digest == art.digest


def test_resume_continues_exactly(tiny_pipeline, tmp_path, reward):
    full, part = tmp_path / "full", tmp_path / "part"
    train.train(tiny_pipeline["packed"], full, **TINY, overrides=OVR)
    assert train.train(tiny_pipeline["packed"], part, stop_after=3, **TINY, overrides=OVR) is None
    assert not (part / names.MANIFEST).exists() and len(_metrics(part)) == 3
    import shutil

    shutil.rmtree(part / "step-00000003")  # as if killed before step 3's checkpoint: resumed from step 2
    with pytest.raises(QerlError, match="unfinished run"):
        train.train(tiny_pipeline["packed"], part, **TINY, overrides=OVR)
    with pytest.raises(QerlError, match="different config"):
        train.train(tiny_pipeline["packed"], part, resume=True, **(TINY | {"lr": 1e-3}), overrides=OVR)
    with pytest.raises(QerlError, match="unfinished train run .* --resume"):
        artifact.open_artifact(part, names.KIND_RUN)  # what report and evaluate say about it
    art = train.train(tiny_pipeline["packed"], part, resume=True, **TINY, overrides=OVR)
    assert art is not None and art.kind == names.KIND_RUN
    assert _deterministic(_metrics(part)) == _deterministic(_metrics(full))
    a, b = _adapter(full / "step-00000004"), _adapter(part / "step-00000004")
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (load_file(str(d / "step-00000004" / names.OPTIMIZER_STATE)) for d in (full, part))
    assert all(torch.equal(oa[k], ob[k]) for k in oa)


def test_stop_after_checkpoints_the_step_it_stops_at(tiny_pipeline, tmp_path, reward):
    """--stop-after N (time-boxed jobs) left no checkpoint of its last steps unless N hit --save-every, so
    --resume silently redid them (all of them at the default save_every of 50) (helper review, session 31)."""
    kw = TINY | {"save_every": 50}
    full, part = tmp_path / "full", tmp_path / "part"
    assert train.train(tiny_pipeline["packed"], part, stop_after=1, **kw, overrides=OVR) is None
    assert (part / "step-00000001").is_dir() and len(_metrics(part)) == 1
    assert train.train(tiny_pipeline["packed"], part, resume=True, stop_after=2, **kw, overrides=OVR) is None
    assert (part / "step-00000003").is_dir() and [m["step"] for m in _metrics(part)] == [1, 2, 3]
    art = train.train(tiny_pipeline["packed"], part, resume=True, **kw, overrides=OVR)
    assert art is not None and [m["step"] for m in _metrics(part)] == [1, 2, 3, 4]
    train.train(tiny_pipeline["packed"], full, **kw, overrides=OVR)
    assert _deterministic(_metrics(part)) == _deterministic(_metrics(full))
    a, b = _adapter(full / "step-00000004"), _adapter(part / "step-00000004")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_a_run_whose_metrics_lost_steps(tiny_pipeline, tmp_path, reward, monkeypatch):
    """(review, session 34) With metrics.jsonl deleted, or cut inside its first line, --resume finished the run
    with only the resumed steps' records (a report then showed 2 of its 4 steps). It now refuses, and a metrics
    file whose records are whole resumes as before."""
    kw = TINY | {"save_every": 50}
    part = tmp_path / "part"
    assert train.train(tiny_pipeline["packed"], part, stop_after=2, **kw, overrides=OVR) is None
    metrics = part / names.RUN_METRICS
    whole = metrics.read_text()
    real_wrap = train.lora.wrap  # (the refusals come before the model loads and is wrapped)
    monkeypatch.setattr(train.lora, "wrap", lambda *a, **k: pytest.fail("the model was loaded before the refusal"))
    for damage, match in ((lambda: metrics.unlink(), "is missing"),
                          (lambda: metrics.write_text(whole[:10]), "does not hold one record for each step"),
                          (lambda: metrics.write_text(whole.splitlines()[1] + "\n"),
                           "does not hold one record for each step")):
        damage()
        with pytest.raises(QerlError, match=match + ".*start it over with --force"):
            train.train(tiny_pipeline["packed"], part, resume=True, **kw, overrides=OVR)
    metrics.write_text(whole)
    monkeypatch.setattr(train.lora, "wrap", real_wrap)
    conf = part / names.RUN_CONFIG  # (unreadable: it was "an unfinished run with a different config")
    kept = conf.read_text()
    conf.write_text("{bad")
    with pytest.raises(QerlError, match="train_config.json is not a readable run config, so it cannot be resumed"):
        train.train(tiny_pipeline["packed"], part, resume=True, **kw, overrides=OVR)
    conf.write_text(kept)
    assert train.train(tiny_pipeline["packed"], part, resume=True, **kw, overrides=OVR) is not None
    assert [m["step"] for m in _metrics(part)] == [1, 2, 3, 4]


def _flip_last_byte(f) -> None:
    """Change one byte of a safetensors file's tensor data (its end): the file still parses, a value differs."""
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 0x01
    f.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage,match", [
    (lambda d: _flip_last_byte(d / names.ADAPTER_WEIGHTS),
     f"is damaged: file '{names.ADAPTER_WEIGHTS}' does not match its sha256"),
    (lambda d: _flip_last_byte(d / names.OPTIMIZER_STATE),
     f"is damaged: file '{names.OPTIMIZER_STATE}' does not match its sha256"),
    (lambda d: (d / names.TRAINER_STATE).write_text((d / names.TRAINER_STATE).read_text().replace('"step": 2', '"step": 3')),
     f"is damaged: file '{names.TRAINER_STATE}' does not match its sha256"),
    (lambda d: (d / names.RNG_STATE).write_bytes((d / names.RNG_STATE).read_bytes()[:-100]),
     f"is damaged: file '{names.RNG_STATE}' has"),
    (lambda d: (d / names.STEP_HASHES).unlink(), f"is incomplete: it lacks {names.STEP_HASHES}"),
], ids=["adapter-byte", "optimizer-byte", "state-edit", "rng-truncated", "no-hashes"])
def test_resume_refuses_a_damaged_or_unhashed_last_checkpoint(tiny_pipeline, tmp_path, reward, damage, match):
    """A checkpoint altered in a way that still loads (a flipped byte in a tensor, an edited state) or one without
    its hash file (cut short, or from a qerl that did not hash checkpoints) was resumed from silently."""
    kw = TINY | {"save_every": 1}
    part = tmp_path / "part"
    assert train.train(tiny_pipeline["packed"], part, stop_after=2, **kw, overrides=OVR) is None
    last = part / "step-00000002"
    hashes = json.loads((last / names.STEP_HASHES).read_text())["files"]
    assert sorted(e["path"] for e in hashes) == sorted(
        p.name for p in last.iterdir() if p.name != names.STEP_HASHES)  # every other file of the step dir
    damage(last)
    before = {p.relative_to(part): p.read_bytes() for p in part.rglob("*") if p.is_file()}
    with pytest.raises(QerlError, match=match) as e:
        train.train(tiny_pipeline["packed"], part, resume=True, **kw, overrides=OVR)
    msg = str(e.value)
    assert str(last) in msg and "delete it to resume from the checkpoint before it" in msg and "--force" in msg
    assert msg.endswith(".") and "\n" not in msg
    # nothing was touched: the damaged checkpoint, the one before it and the metrics are as they were
    assert {p.relative_to(part): p.read_bytes() for p in part.rglob("*") if p.is_file()} == before
    # the advice works: without the damaged checkpoint the run resumes from the one before it
    import shutil

    shutil.rmtree(last)
    art = train.train(tiny_pipeline["packed"], part, resume=True, **kw, overrides=OVR)
    assert art is not None and [m["step"] for m in _metrics(part)] == [1, 2, 3, 4]


def test_resume_of_a_damaged_checkpoint_is_one_sentence_on_the_cli(tiny_pipeline, tmp_path, reward):
    conf = tmp_path / "train.toml"
    conf.write_text("dynamic_sampling = false\nlora_rank = 4\nlora_alpha = 8.0\nbatch_prompts = 1\n")
    kw = TINY | {"save_every": 1}
    part = tmp_path / "part"
    assert train.train(tiny_pipeline["packed"], part, stop_after=1, config_file=conf, **kw) is None
    _flip_last_byte(part / "step-00000001" / names.OPTIMIZER_STATE)
    r = run_cli("train", str(tiny_pipeline["packed"]), "-o", str(part), "--resume", "--config", str(conf),
                "--task", kw["task"], "--steps", str(kw["steps"]), "--prompts-per-step", str(kw["prompts_per_step"]),
                "-G", str(kw["group"]), "--max-new-tokens", str(kw["max_new_tokens"]), "--lr", str(kw["lr"]),
                "--save-every", "1", "--sigma-stages", str(kw["sigma_stages"]), "--sigma-start",
                str(kw["sigma_start"]), "--sigma-end", str(kw["sigma_end"]), "--no-progress")
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the checkpoint ") and lines[0].endswith("--force."), lines
    assert f"'{names.OPTIMIZER_STATE}' does not match its sha256" in lines[0]
    assert [m["step"] for m in _metrics(part)] == [1]


def test_nan_logits_in_a_rollout_stop_training_with_one_sentence(tiny_pipeline, tmp_path):
    """lr 1e30 makes the adapter huge but finite after step 1 (so the trainer's own check passes), and the
    rollout of step 2 overflows to NaN logits: torch.multinomial raised a RuntimeError (a traceback from `qerl
    train`); now it is the engine's sentence, exit 1, and the run keeps what it had (unfinished, step 1 logged)."""
    script = tmp_path / "nan_train.py"
    conf = tmp_path / "train.toml"
    conf.write_text("dynamic_sampling = false\nlora_rank = 4\nlora_alpha = 8.0\nbatch_prompts = 1\n")
    run = tmp_path / "run"
    script.write_text(REWARD_PATCH + textwrap.dedent(f'''
        import sys
        from qerl_cli import rollout
        from qerl_cli.cli import main
        rollout.score_batch = _fake_score
        sys.argv = ["qerl", "train", {str(tiny_pipeline["packed"])!r}, "-o", {str(run)!r}, "--config", {str(conf)!r},
                    "--task", "arith:16", "--steps", "4", "--prompts-per-step", "2", "-G", "4", "--max-new-tokens", "6",
                    "--lr", "1e30", "--save-every", "2", "--sigma-start", "0", "--sigma-end", "0", "--no-progress"]
        main()
    '''))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: the model's logits are not finite (NaN or Inf) at decode step 1 of 6")
    assert lines[-1].endswith(".") and [ln for ln in lines if not ln.startswith("step ")] == lines[-1:], lines
    assert [m["step"] for m in _metrics(run)] == [1] and not (run / names.MANIFEST).exists()
    assert (run / names.RUN_CONFIG).is_file()


def test_nan_gradients_still_stop_training_as_diverged(tiny_pipeline, tmp_path, reward, monkeypatch):
    """The trainer's own check: NaN training log-probs (so NaN gradients and a NaN adapter after the update) stop
    the run at that step, before the next rollout samples from it."""
    tf = Engine.sequence_logprobs

    def nan_logprobs(self, *a, **k):
        return tf(self, *a, **k) * float("nan")

    monkeypatch.setattr(Engine, "sequence_logprobs", nan_logprobs)
    with pytest.raises(QerlError, match=r"training diverged at step 1: the adapter's weights are no longer finite"):
        train.train(tiny_pipeline["packed"], tmp_path / "run", **TINY, overrides=OVR)
    assert not list((tmp_path / "run").glob("step-*"))


def test_heldout_evaluation_and_time_budget(tiny_pipeline, tmp_path, reward):
    ovr = OVR | {"eval_every": 2, "eval_problems": 6}
    run = tmp_path / "run"
    art = train.train(tiny_pipeline["packed"], run, **TINY, overrides=ovr)
    ms = _metrics(run)
    assert [m["step"] for m in ms] == [0, 1, 2, 3, 4]
    assert set(ms[0]) == {"step", "time_elapsed_s", "heldout_accuracy", "heldout_ci95", "heldout_n",
                          "heldout_distinct_questions", "heldout_n_eff", "heldout_parse_failure_rate",
                          "heldout_truncation_rate", "time_eval_s"}
    assert [("heldout_accuracy" in m) for m in ms] == [True, False, True, False, True]
    assert all(m["heldout_n"] == 6 and 0 <= m["heldout_accuracy"] <= 1 for m in ms if "heldout_n" in m)
    assert ms[2]["heldout_ci95"][0] <= ms[2]["heldout_accuracy"] <= ms[2]["heldout_ci95"][1]
    for m in (ms[0], ms[2], ms[4]):  # a Wilson interval at the clustered effective size (repeats: one cluster)
        assert m["heldout_n_eff"] <= m["heldout_n"]
        assert m["heldout_ci95"] == list(stats.wilson(m["heldout_accuracy"] * m["heldout_n_eff"], m["heldout_n_eff"]))
    elapsed = [m["time_elapsed_s"] for m in ms[1:]]
    assert elapsed == sorted(elapsed) and elapsed[-1] == pytest.approx(sum(m["time_step_s"] for m in ms[1:]))
    assert art.metrics["heldout_accuracy_first"] == ms[0]["heldout_accuracy"]
    assert art.metrics["stopped_by"] == "steps" and art.metrics["steps"] == 4
    # the held-out set: fixed (seed 0 of the held-out split), disjoint from training, same sampling seed
    recorded = json.loads((run / names.RUN_CONFIG).read_text())["config"]
    cfg = train.TrainConfig(**{k: v for k, v in recorded.items()
                               if k not in ("verifier", "prompt_format")})  # (recorded beside the config)
    held = train.heldout_problems(cfg)
    assert len(held) == 6 and not {p.question for p in held} & {p.question for p in tasks.load_problems("arith:16")}
    # a time budget finishes the run early: checkpoint, evaluation and manifest at the stopping step
    budget = train.train(tiny_pipeline["packed"], tmp_path / "budget", **TINY,
                         overrides=ovr | {"time_budget_s": 1e-6})
    mb = _metrics(budget.path)
    assert [m["step"] for m in mb] == [0, 1] and "heldout_accuracy" in mb[1]
    assert budget.metrics["stopped_by"] == "time_budget" and budget.metrics["steps"] == 1
    assert (budget.path / "step-00000001" / names.ADAPTER_WEIGHTS).is_file()
    # identical policy, seed and problems: the step-0 evaluation repeats exactly
    assert _deterministic(mb[:1]) == _deterministic(ms[:1])
    with pytest.raises(QerlError, match="eval_task"):
        train.train(tiny_pipeline["packed"], tmp_path / "x", **(TINY | {"task": str(tiny_pipeline["packed"])}),
                    overrides=ovr)


def test_heldout_set_is_never_the_training_split(tiny_pipeline):
    base = train.TrainConfig(**_resolved(tiny_pipeline))
    arith = train.heldout_problems(_with(base, eval_task="arith:64"))
    assert arith == tasks.arithmetic_problems(len(arith), 0, "heldout")
    train_qs = {p.question for p in tasks.load_problems("arith:4096", 0)}
    assert not {p.question for p in arith} & train_qs


def test_resume_before_the_first_checkpoint_redoes_the_step0_evaluation(tiny_pipeline, tmp_path, reward,
                                                                         monkeypatch):
    ovr = OVR | {"eval_every": 2, "eval_problems": 4}
    said = []
    monkeypatch.setattr(train.ui, "info", lambda msg: said.append(msg))
    run = tmp_path / "run"
    assert train.train(tiny_pipeline["packed"], run, stop_after=1, **TINY, overrides=ovr) is None
    assert [m["step"] for m in _metrics(run)] == [0, 1]
    import shutil

    shutil.rmtree(run / "step-00000001")  # as if killed before step 1's checkpoint: no checkpoint yet
    said.clear()
    train.train(tiny_pipeline["packed"], run, resume=True, **TINY, overrides=ovr)
    assert [m["step"] for m in _metrics(run)] == [0, 1, 2, 3, 4]  # one step-0 line, not two
    assert any("no complete checkpoint yet; resuming from step 0" in m for m in said)  # (said, not silent)


def test_heldout_evaluation_policy(tiny_pipeline, tmp_path, reward, monkeypatch):
    """The evaluation samples at eval_temperature with AQN off, one sample per held-out problem."""
    seen = []
    generate = Engine.generate

    def spy(self, prompts, group, sampling, *a, **k):
        seen.append((len(prompts), group, sampling.temperature, self.noise.sigma))
        if group != 1 and self.noise.sigma > 0:
            seeds.append(self.noise.seed)
        return generate(self, prompts, group, sampling, *a, **k)

    seeds = []
    monkeypatch.setattr(Engine, "generate", spy)
    kw = TINY | {"steps": 2, "save_every": 2, "sigma_stages": 2, "sigma_start": 0.1, "sigma_end": 0.1}
    train.train(tiny_pipeline["packed"], tmp_path / "run", **kw,
                overrides=OVR | {"eval_every": 2, "eval_problems": 5, "eval_temperature": 0.0, "temperature": 0.7})
    # the noise seeds the rollouts used are logged, and the documented formula reproduces them
    logged = [m for m in _metrics(tmp_path / "run") if "noise_seeds" in m]
    assert [m["noise_seeds"] for m in logged] == [[], seeds]  # step 1 is stage 0 (sigma 0), step 2 is noisy
    import hashlib
    calls = range(0, TINY["prompts_per_step"], OVR["batch_prompts"])
    seed = json.loads((tmp_path / "run" / names.RUN_CONFIG).read_text())[names.K_CONFIG]["seed"]
    want = [int.from_bytes(hashlib.sha256(f"{seed}:noise:1:0:{p}".encode()).digest()[:8], "little") >> 1
            for p in calls]
    assert seeds == want and len(set(seeds)) == len(seeds) > 1
    evals = [s for s in seen if s[1] == 1]
    rollouts = [s for s in seen if s[1] != 1]
    assert evals and all(t == 0.0 and sigma == 0.0 for _, _, t, sigma in evals)
    assert sum(n for n, *_ in evals) == 2 * 5  # before step 1 and after step 2, 5 problems each
    assert all(t == 0.7 for _, _, t, _ in rollouts) and any(sigma == pytest.approx(0.1) for *_, sigma in rollouts)


def test_gradient_checkpointing_gives_the_same_training(tiny_pipeline, tmp_path, reward):
    kw = TINY | {"steps": 2, "save_every": 2, "sigma_stages": 2, "sigma_start": 0.05, "sigma_end": 0.05}
    plain = train.train(tiny_pipeline["packed"], tmp_path / "plain", **kw, overrides=OVR)
    ckpt = train.train(tiny_pipeline["packed"], tmp_path / "ckpt", **kw,
                       overrides=OVR | {"gradient_checkpointing": True})
    mp, mc = _metrics(plain.path), _metrics(ckpt.path)
    assert mp[-1]["loss"] != 0
    for a, b in zip(mp, mc):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-7)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5)
    a, b = _adapter(plain.path / "step-00000002"), _adapter(ckpt.path / "step-00000002")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_engine_checkpointing_recomputes_layers(tiny_pipeline):
    model, tok, _, _ = rollout.load_policy(tiny_pipeline["packed"], "cpu")
    pm = lora.wrap(model, 4, 8.0, ("q_proj", "down_proj"), 0)
    with torch.no_grad():
        for _, prm in lora.trainable(pm):
            prm.normal_(0, 0.05)
    grads = []
    for flag in (False, True):
        eng = Engine(pm.get_base_model(), "cpu", grad_checkpoint=flag)
        calls, layer = [], eng._layer
        eng._layer = lambda i, *a: calls.append(i) or layer(i, *a)
        lp = eng.sequence_logprobs([[1, 2, 3], [4, 5]], torch.tensor([[6, 7], [8, 9]]), torch.ones(2, 2, dtype=torch.bool),
                                   1.0, 0)
        pm.zero_grad()
        lp.sum().backward()
        grads.append([prm.grad.clone() for _, prm in lora.trainable(pm)])
        assert calls == ([0, 1, 1, 0] if flag else [0, 1])  # the backward pass ran the layers again
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(*grads))


def test_replay_objective_reproduces_the_behaviour_policy(tiny_pipeline, tmp_path, reward):
    kw = TINY | {"steps": 2, "sigma_stages": 2, "sigma_start": 0.2, "sigma_end": 0.2, "save_every": 2}
    ovr = OVR | {"noise_scope": "group", "batch_prompts": 2}
    clean = train.train(tiny_pipeline["packed"], tmp_path / "clean", **kw, overrides=ovr)
    replay = train.train(tiny_pipeline["packed"], tmp_path / "replay", objective="replay", **kw, overrides=ovr)
    mc, mr = _metrics(clean.path)[1], _metrics(replay.path)[1]
    assert mc["sigma"] == mr["sigma"] == pytest.approx(0.2)
    # same data (same first step); the replayed forward matches what sampled it, the clean one does not
    assert mr["logprob_gap_abs"] < 1e-3 < mc["logprob_gap_abs"]
    assert json.loads((replay.path / names.RUN_CONFIG).read_text())["config"]["objective"] == "replay"


def test_peft_adapter_format(tiny_pipeline, tmp_path):
    """The saved adapter is PEFT format: our engine (packed, LoRA via peft) == our engine (packed, LoRA read
    from the dir); peft's PeftModel on the bf16 model == our engine on the bf16 model with the adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, tok, _, _ = rollout.load_policy(tiny_pipeline["packed"], "cpu")
    pm = lora.wrap(model, 4, 8.0, seed=1)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in lora.trainable(pm):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    assert all(type(m).__name__ == "PackedLoraLinear" for n, m in pm.named_modules() if n.endswith("q_proj"))
    lora.save_adapter(pm, tmp_path / "ad")
    assert sorted(p.name for p in (tmp_path / "ad").iterdir()) == [names.ADAPTER_CONFIG, names.ADAPTER_WEIGHTS]
    ids = torch.tensor([tasks.chat_prompt(tok, "What is 3 + 4?")])
    key = torch.ones_like(ids, dtype=torch.bool)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        ours_peft = Engine(pm.get_base_model()).forward(ids, pos, key)
        plain, _, _, _ = rollout.load_policy(tiny_pipeline["packed"], "cpu")
        eng = Engine(plain)
        eng.set_adapter(load_lora(tmp_path / "ad", plain))
        ours_dir = eng.forward(ids, pos, key)
    assert torch.allclose(ours_peft, ours_dir, atol=1e-4)

    # the unquantized source model (stored in bf16), run in fp32 so the comparison is tight on CPU
    base = AutoModelForCausalLM.from_pretrained(str(tiny_pipeline["model"]), dtype=torch.float32)
    bf_eng = Engine(base)
    with torch.no_grad():
        no_ad = bf_eng.forward(ids, pos, key).float()
        bf_eng.set_adapter(load_lora(tmp_path / "ad", base))
        with_ad = bf_eng.forward(ids, pos, key).float()
        peft_logits = PeftModel.from_pretrained(base, str(tmp_path / "ad")).eval()(ids).logits.float()
    effect = (with_ad - no_ad).abs().max()
    assert effect > 0.5  # the adapter matters...
    assert (peft_logits - with_ad).abs().max() < 1e-3 * effect  # ...and peft applies it as we do


def test_train_refuses_unverified_and_records_skip(tiny_pipeline, tmp_path, reward):
    import shutil

    p2 = tmp_path / "p2"
    shutil.copytree(tiny_pipeline["packed"], p2)
    with pytest.raises(QerlError, match="has not been verified"):
        train.train(p2, tmp_path / "run", **TINY, overrides=OVR)
    assert not (tmp_path / "run").exists()
    art = train.train(p2, tmp_path / "run", skip_verify=True, **(TINY | {"steps": 1, "sigma_stages": 1}), overrides=OVR)
    assert art.config["skip_verify"] is True
    assert "skipped" in json.loads((art.path / names.RUN_CONFIG).read_text())["policy"]["verify"]
    with pytest.raises(QerlError, match="invalid train config"):
        train.train(p2, tmp_path / "bad", skip_verify=True, **(TINY | {"group": 1}), overrides=OVR)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("dynamic", [False, True])
def test_data_parallel_gloo_matches_single_process(tiny_pipeline, tmp_path, dynamic):
    """dynamic: the first informative groups of the global draw are kept, as in one process (review, session 26:
    each rank filled its own quota from its own shard, and the adapters differed by up to 0.015 at seed 0)."""
    script = tmp_path / "dp.py"
    script.write_text(REWARD_PATCH + textwrap.dedent(f'''
        import sys
        from qerl_cli import rollout, train
        rollout.score_batch = _fake_score
        train.train({str(tiny_pipeline["packed"])!r}, sys.argv[1], task="arith:16", steps=2, prompts_per_step=4,
                    group=4, max_new_tokens=6, lr=5e-3, save_every=2, sigma_stages=2, sigma_start=0.05,
                    sigma_end=0.05, progress=False,
                    overrides={{"dynamic_sampling": {dynamic}, "max_sampling_rounds": 3, "lora_rank": 4,
                               "lora_alpha": 8.0, "batch_prompts": 2, "num_iterations": 2, "eval_every": 2,
                               "eval_problems": 20}})
    '''))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    single = subprocess.run([sys.executable, str(script), str(tmp_path / "single")], capture_output=True, text=True,
                            env=env, timeout=300)
    assert single.returncode == 0, single.stderr[-3000:]
    dp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script),
                         str(tmp_path / "dp")], capture_output=True, text=True, env=env, timeout=300)
    assert dp.returncode == 0, dp.stderr[-3000:]
    a, b = _adapter(tmp_path / "single" / "step-00000002"), _adapter(tmp_path / "dp" / "step-00000002")
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-5, rtol=1e-4), k
    ms, md = _metrics(tmp_path / "single"), _metrics(tmp_path / "dp")
    # held-out evaluations (20 problems in chunks of 8 rows, dealt to the ranks): the same as one process
    assert [m["step"] for m in md if "heldout_accuracy" in m] == [0, 2]
    for x, y in zip(ms, md):
        if "heldout_accuracy" in x:
            assert x["heldout_accuracy"] == y["heldout_accuracy"] and x["heldout_n"] == y["heldout_n"] == 20
        if "time_step_s" not in x:
            continue
        for k in ("reward_mean", "accuracy", "informative_fraction", "groups_sampled", "groups_trained",
                  "sampling_rounds", "response_length_mean"):
            assert x[k] == pytest.approx(y[k]), k
        assert x["loss"] == pytest.approx(y["loss"], abs=1e-5)
    if dynamic:  # the case that tells: a step that sampled again, after some groups were kept in the first round
        assert any(m.get("sampling_rounds", 1) > 1 and m["groups_trained"] > 0 for m in ms), ms
    rc = json.loads((tmp_path / "dp" / names.RUN_CONFIG).read_text())
    assert rc["config"]["world_size"] == 2
    assert not (tmp_path / "dp" / names.MANIFEST).read_text().count("tmp-")


def test_data_parallel_time_budget_stops_every_rank_at_the_same_step(tiny_pipeline, tmp_path):
    """Rank 1 is slower; the budget is judged on the slowest clock, so both ranks finish at the same step
    (deciding per rank would leave them in different collectives: a hang)."""
    script = tmp_path / "dp_budget.py"
    script.write_text(REWARD_PATCH + textwrap.dedent(f'''
        import os, sys, time
        from qerl_cli import rollout, train
        rollout.score_batch = _fake_score
        step = train.Trainer.step
        def slow_step(self, s):
            if os.environ.get("RANK") == "1":
                time.sleep(0.6)
            return step(self, s)
        train.Trainer.step = slow_step
        train.train({str(tiny_pipeline["packed"])!r}, sys.argv[1], task="arith:16", steps=6, prompts_per_step=4,
                    group=2, max_new_tokens=4, lr=5e-3, save_every=6, progress=False, sigma_start=0.0, sigma_end=0.0,
                    overrides={{"dynamic_sampling": False, "lora_rank": 4, "lora_alpha": 8.0, "batch_prompts": 2,
                               "time_budget_s": 1.0}})
    '''))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    dp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                         "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), str(script),
                         str(tmp_path / "dp")], capture_output=True, text=True, env=env, timeout=240)
    assert dp.returncode == 0, dp.stderr[-3000:]
    art = artifact.open_artifact(tmp_path / "dp", names.KIND_RUN)
    assert art.metrics["stopped_by"] == "time_budget" and 1 <= art.metrics["steps"] < 6
    assert (tmp_path / "dp" / f"step-{art.metrics['steps']:08d}").is_dir()


def test_cli_smollm2_quantize_pack_verify_train(tmp_path):
    quant, packed, ver, run = (tmp_path / n for n in ("quant", "packed", "verify", "run"))
    light = tmp_path / "verify.toml"
    light.write_text('batch_sizes = [1]\nprompts = ["What is 7 + 5?"]\n')
    for args in (("quantize", "smollm2-135m-instruct", "-o", str(quant)), ("pack", str(quant), "-o", str(packed)),
                 ("verify", str(packed), "-o", str(ver), "--config", str(light))):
        r = run_cli(*args, "--no-progress")
        assert r.returncode == 0, (args, r.stderr[-2000:])
    r = run_cli("train", str(packed), "--task", "arith", "--steps", "2", "--sigma-stages", "2", "--sigma-end", "1e-2",
                "--prompts-per-step", "2", "-G", "2", "--max-new-tokens", "16", "--save-every", "1", "-o", str(run),
                "--no-progress")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step 2/2" in r.stderr
    art = artifact.open_artifact(run, names.KIND_RUN)
    assert art.config["group"] == 2 and art.config["lora_rank"] == 32
    ms = _metrics(run)
    assert len(ms) == 2 and DIAGNOSTIC_KEYS <= set(ms[1])
    assert {"step-00000001", "step-00000002"} <= {p.name for p in run.iterdir()}
    assert sorted(load_lora(run / "step-00000002", _tiny_shapes(packed)).factors)[:1]
    # unfinished run without --resume, then a wrong kind: one clear sentence, exit 1
    r = run_cli("train", str(quant), "--task", "arith", "-o", str(tmp_path / "x"), "--no-progress")
    assert r.returncode == 1 and r.stderr.startswith("error:") and "'quant' artifact" in " ".join(r.stderr.split())


def _tiny_shapes(packed):
    from qerl_cli.packed_model import load_packed_model

    return load_packed_model(artifact.open_artifact(packed, names.KIND_PACKED))


@pytest.mark.parametrize("ovr,match", [
    ({"steps": 4, "sigma_stages": 10}, r"steps \(4\) must be >= sigma_stages \(10\)"),
    ({"sigma_stages": 2, "sigma_start": 0.0, "sigma_end": 0.01}, "both > 0"),
    ({"sigma_stages": 2, "sigma_start": 0.02, "sigma_end": 0.01}, "single noisy stage"),
    ({"sigma_stages": 4, "sigma_start": 0.01, "sigma_end": 0.0}, "both > 0"),
    ({"temperature": 0.0}, "temperature must be > 0 for training"),
    # (review, session 19) truncated draws would start every importance ratio below 1; AdamW's own check fired
    # only after the model loaded, with a traceback; a negative count silently cut a file task
    ({"top_p": 0.9}, "top_k and top_p must be off"),
    ({"top_k": 20}, "top_k and top_p must be off"),
    ({"adam_beta1": 1.5}, r"adam_beta1 and adam_beta2 must be in \[0, 1\)"),
    ({"weight_decay": -0.1}, "weight_decay finite and >= 0"),
    ({"num_problems": -7}, r"num_problems must be >= 0"),
    # (review, session 26) a buffer above the limit penalised every completion (length 1 of 16 with buffer 64:
    # -0.77); adv_eps -0.5 gave infinite advantages to rewards [0, 1]; eps_low >= 1 removed the lower clip
    ({"overlong_buffer": 300, "max_new_tokens": 256}, r"overlong_buffer \(300\) must be <= max_new_tokens \(256\)"),
    ({"adv_eps": -0.5}, "adv_eps and overlong_penalty must be finite and >= 0"),
    ({"overlong_penalty": -1.0}, "adv_eps and overlong_penalty must be finite and >= 0"),
    ({"eps_low": 1.0}, r"eps_low in \[0, 1\)"),
    ({"eps_high": float("nan")}, r"eps_high in \[0, 1e\+06\]"),
    # (review, session 31) each of these started the run and failed later with another cause named (NaN sigma at
    # the first noisy stage, a NaN format reward as "diverged: lower lr", 1 + 1e39 as an fp32 overflow traceback)
    # or ran to the end changing nothing (lora_alpha 0: every update scaled to zero)
    ({"sigma_start": float("nan"), "sigma_end": float("nan")}, "sigma_start and sigma_end must be finite"),
    ({"sigma_end": float("inf")}, "sigma_start and sigma_end must be finite"),
    ({"lora_alpha": 0.0}, "lora_alpha must be finite and > 0"),
    ({"lora_alpha": float("nan")}, "lora_alpha must be finite and > 0"),
    ({"format_reward": float("nan")}, "format_reward must be a finite number"),
    ({"eps_high": 1e39}, r"eps_high in \[0, 1e\+06\]"),
])
def test_schedules_that_cannot_be_followed_are_refused(ovr, match):
    from qerl_cli import config

    with pytest.raises(QerlError, match=match):
        config.load("train", train.TrainConfig, None, ovr)


def test_noise_off_with_few_steps_is_accepted():
    from qerl_cli import config

    cfg = config.load("train", train.TrainConfig, None, {"steps": 2, "sigma_start": 0.0, "sigma_end": 0.0})
    assert [cfg.sigma(s) for s in range(2)] == [0.0, 0.0]


def test_logprob_gap_is_measured_before_the_update_drifts_the_policy(tiny_pipeline, tmp_path, reward):
    """With several minibatches the later ones are evaluated after optimizer steps; the logged gap is taken before
    the first, so with no noise (fp32, CPU) it is the sampler/trainer mismatch alone: about zero."""
    kw = TINY | {"steps": 2, "prompts_per_step": 4, "sigma_start": 0.0, "sigma_end": 0.0, "save_every": 2}
    art = train.train(tiny_pipeline["packed"], tmp_path / "run", **kw,
                      overrides=OVR | {"minibatches": 4, "batch_prompts": 2, "lr": 5e-2})
    ms = _metrics(art.path)
    assert all(m["optimizer_steps"] == 4 for m in ms)
    assert all(m["logprob_gap_abs"] < 1e-5 for m in ms), [m["logprob_gap_abs"] for m in ms]
    assert ms[-1]["lr"] > 0 and ms[-1]["adapter_norm"] != ms[0]["adapter_norm"]  # the policy moved in each step


def test_resume_is_exact_with_every_stateful_option_on(tiny_pipeline, tmp_path, reward):
    """Resume with dynamic sampling (refill rounds draw from the prompt stream), replayed per-group noise,
    several minibatches and iterations, sequence aggregation, the overlong penalty and warm-up: the same metrics,
    adapter and optimizer state as the uninterrupted run."""
    kw = TINY | {"steps": 4, "prompts_per_step": 4, "sigma_stages": 2, "sigma_start": 0.1, "sigma_end": 0.1}
    ovr = OVR | {"dynamic_sampling": True, "max_sampling_rounds": 2, "noise_scope": "group", "batch_prompts": 2,
                 "minibatches": 2, "num_iterations": 2, "loss_aggregation": "sequence", "overlong_buffer": 2,
                 "warmup_steps": 1, "weight_decay": 0.01}
    full = train.train(tiny_pipeline["packed"], tmp_path / "full", objective="replay", **kw, overrides=ovr)
    part = tmp_path / "part"
    assert train.train(tiny_pipeline["packed"], part, objective="replay", stop_after=2, **kw, overrides=ovr) is None
    train.train(tiny_pipeline["packed"], part, objective="replay", resume=True, **kw, overrides=ovr)
    mf, mp = _metrics(full.path), _metrics(part)
    assert _deterministic(mp) == _deterministic(mf)
    assert any(m["sampling_rounds"] > 1 for m in mf) and all(m["optimizer_steps"] == 4 for m in mf)
    a, b = _adapter(full.path / "step-00000004"), _adapter(part / "step-00000004")
    assert all(torch.equal(a[k], b[k]) for k in a)
    oa, ob = (load_file(str(d / "step-00000004" / names.OPTIMIZER_STATE)) for d in (full.path, part))
    assert all(torch.equal(oa[k], ob[k]) for k in oa)


def test_too_many_new_tokens_is_refused_before_anything_is_written(tiny_pipeline, tmp_path):
    """(review, session 19) max_new_tokens past the model's positions was refused only at the first rollout, after
    the run directory was written, and the corrected command then met an "unfinished run": now one sentence
    before anything is written."""
    run = tmp_path / "run"
    with pytest.raises(QerlError, match="more than the model's max_position_embeddings"):
        train.train(tiny_pipeline["packed"], run, **(TINY | {"max_new_tokens": 100_000}), overrides=OVR)
    assert not run.exists()


def test_step_passes_every_objective_option_through(tiny_pipeline, tmp_path, reward, monkeypatch):
    """(review, session 27) The grpo functions are checked by hand values, but eps_high, mask_truncated,
    loss_aggregation, adv_scale/adv_eps and the overlong penalty could be dropped on the way from the config to
    them with every test passing: record what one step hands them, with every option off its default."""
    from qerl_cli import grpo

    seen: dict[str, list] = {}

    def spy(name):
        real = getattr(grpo, name)

        def wrapped(*a, **k):
            seen.setdefault(name, []).append(a)
            if name == "loss_mask":  # (the tiny model's completions all run to the limit: keep their tokens)
                a = (*a[:2], False)
            return real(*a, **k)
        monkeypatch.setattr(grpo, name, wrapped)

    for name in ("clipped_surrogate", "loss_mask", "group_advantages", "overlong_penalty", "denominator"):
        spy(name)
    ovr = OVR | {"eps_low": 0.15, "eps_high": 0.35, "mask_truncated": True, "loss_aggregation": "sequence",
                 "adv_scale": "batch", "adv_eps": 1e-3, "overlong_buffer": 3, "overlong_penalty": 0.7}
    train.train(tiny_pipeline["packed"], tmp_path / "run", **(TINY | {"steps": 1, "save_every": 1, "sigma_stages": 1}),
                overrides=ovr)
    assert seen["overlong_penalty"] and all(a[1:] == (6, 3, 0.7) for a in seen["overlong_penalty"])
    assert seen["loss_mask"] and all(a[2] is True for a in seen["loss_mask"])
    assert seen["denominator"] and all(a[1] == "sequence" for a in seen["denominator"])
    assert seen["group_advantages"] and all(a[1:4] == (4, "batch", 1e-3) for a in seen["group_advantages"])
    assert seen["clipped_surrogate"] and all(a[4:7] == (0.15, 0.35, "sequence") for a in seen["clipped_surrogate"])


def test_run_key_holds_what_changes_the_run_and_nothing_else(tiny_pipeline, tmp_path, reward, monkeypatch):
    """(review, session 31) The run's key missed two things that change its results, an engine switch (another
    sampler draws other tokens) and the held-out problems (an edited eval file served the old held-out accuracy),
    and held two that change nothing: num_problems typed as the set's size rather than 0 (= all), and the held-out
    settings of a run that never evaluates. A cached rerun also read the whole model before finding the cache."""
    from qerl_cli import packed_model

    kw = TINY | {"steps": 1, "save_every": 1, "sigma_start": 0.0, "sigma_end": 0.0}
    ovr = OVR | {"eval_every": 0}
    a = train.train(tiny_pipeline["packed"], tmp_path / "a", **kw, overrides=ovr)
    real_load = packed_model.load_packed_model
    monkeypatch.setattr(packed_model, "load_packed_model", lambda *x, **k: pytest.fail("a cache hit read the model"))
    same = train.train(tiny_pipeline["packed"], tmp_path / "a", **kw,
                       overrides=ovr | {"num_problems": 16, "eval_problems": 7, "eval_temperature": 0.5})
    assert same.digest == a.digest and a.config["num_problems"] == 16
    monkeypatch.setenv("QERL_ENGINE_FUSED_SAMPLER", "0")
    with pytest.raises(QerlError, match="already holds a different 'run' artifact"):
        train.train(tiny_pipeline["packed"], tmp_path / "a", **kw, overrides=ovr)
    monkeypatch.delenv("QERL_ENGINE_FUSED_SAMPLER")
    monkeypatch.setattr(packed_model, "load_packed_model", real_load)
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps({"question": f"What is {i} + 2?", "answer": f"#### {i + 2}"}) + "\n"
                            for i in range(3)))
    ovr_eval = OVR | {"eval_every": 1, "eval_task": str(held), "eval_problems": 3}
    b = train.train(tiny_pipeline["packed"], tmp_path / "b", **kw, overrides=ovr_eval)
    assert "heldout" in [i[names.K_KIND] for i in b.manifest[names.K_INPUTS]]
    held.write_text(held.read_text().replace("#### 2", "#### 9"))
    with pytest.raises(QerlError, match="already holds a different 'run' artifact"):
        train.train(tiny_pipeline["packed"], tmp_path / "b", **kw, overrides=ovr_eval)


def test_an_adapter_is_refused_on_another_model_of_its_shapes(tiny_pipeline, tmp_path, reward, smollm2_tokenizer):
    """(review, session 31) An adapter fit any model of its shapes: one trained on a pack of one fine-tune was run
    on another fine-tune of the same architecture without a word. The saved adapter now names the source model it
    was trained on (through the pack's lineage), and rollout and evaluate refuse it on another model's weights;
    on that model itself, its pack or its quant, it runs."""
    from conftest import build_tiny_llama
    from qerl_cli import evaluate
    from qerl_cli.adapter import load_lora

    kw = TINY | {"steps": 1, "save_every": 1, "sigma_start": 0.0, "sigma_end": 0.0}
    run = train.train(tiny_pipeline["packed"], tmp_path / "run", **kw, overrides=OVR)
    ad = run.path / names.STEP_DIR.format(1)
    source = rollout.base_model([artifact.open_artifact(tiny_pipeline["packed"], names.KIND_PACKED)])
    assert load_lora(ad, None).base_model == source and source["digest"].startswith("sha256:")
    other = build_tiny_llama(tmp_path / "other", smollm2_tokenizer, seed=5)  # (same shapes, other weights)
    ekw = dict(num_examples=1, max_new_tokens=2, progress=False)
    with pytest.raises(QerlError, match=r"was trained on the model .* but this policy's weights come from .*other"):
        evaluate.evaluate(str(other), "arith:1", tmp_path / "e-other", adapter=ad, **ekw)
    with pytest.raises(QerlError, match="was trained on the model"):
        rollout.rollout(str(other), "arith:1", tmp_path / "r-other", adapter=ad, group=1, max_new_tokens=2,
                        progress=False)
    assert not (tmp_path / "e-other").exists() and not (tmp_path / "r-other").exists()
    for src in (tiny_pipeline["model"], tiny_pipeline["quant"], tiny_pipeline["packed"]):
        evaluate.evaluate(str(src), "arith:1", tmp_path / f"e-{Path(src).name}", adapter=ad, **ekw)
