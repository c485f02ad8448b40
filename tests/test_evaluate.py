"""evaluate and report: declared policy, adapter really applied, Wilson intervals, paired comparison."""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path

import pytest

from conftest import SHARED_DATA, random_adapter, run_cli
from qerl_cli import artifact, evaluate, names, report, stats
from qerl_cli.errors import QerlError


@pytest.fixture(scope="module")
def packed(tiny_pipeline):
    """The session's tiny quant/pack/verify artifacts (shared, read-only), addressed by their parent dir."""
    root = tiny_pipeline["packed"].parent
    assert tiny_pipeline["quant"].parent == root and tiny_pipeline["verify"].parent == root
    return root


def test_adapter_is_applied_in_evaluation(packed, tmp_path, monkeypatch):
    from qerl_cli import packed_model

    kw = dict(num_examples=4, max_new_tokens=8, progress=False)
    a = evaluate.evaluate(packed / "packed", "arith:4", tmp_path / "without", **kw)
    b = evaluate.evaluate(packed / "packed", "arith:4", tmp_path / "with", adapter=random_adapter(tmp_path / "ad", 1.0), **kw)
    ca = [json.loads(x)["samples"][0]["completion"] for x in a.file(names.EVAL_EXAMPLES).read_text().splitlines()]
    cb = [json.loads(x)["samples"][0]["completion"] for x in b.file(names.EVAL_EXAMPLES).read_text().splitlines()]
    assert ca != cb  # the adapter changed what the policy says
    sa = json.loads(a.file(names.EVAL_SUMMARY).read_text())
    sb = json.loads(b.file(names.EVAL_SUMMARY).read_text())
    assert sa["policy"]["adapter_digest"] is None and sb["policy"]["adapter_digest"]
    assert any(i["kind"] == "adapter" for i in b.inputs)
    assert sb["policy"]["aqn"] == {"sigma": 0.0, "seed": None}  # AQN off by default
    assert sb["policy"]["temperature"] == 0.0 and sb["policy"]["sampling_seed"] is None  # greedy: no seed
    # the same evaluation again (with its adapter): a cache hit that loads no model (review, session 26)
    monkeypatch.setattr(packed_model, "load_packed_model", lambda *a, **k: pytest.fail("a cache hit loaded the model"))
    again = evaluate.evaluate(packed / "packed", "arith:4", tmp_path / "with", adapter=tmp_path / "ad", **kw)
    assert again.digest == b.digest


def test_eval_artifact_contents_and_sources(packed, tmp_path):
    gsm = str(SHARED_DATA / "gsm8k" / "test.jsonl")
    a = evaluate.evaluate(packed / "quant", gsm, tmp_path / "q", num_examples=3, max_new_tokens=6, progress=False)
    assert sorted(f["path"] for f in a.manifest["files"]) == [names.EVAL_EXAMPLES, names.EVAL_SUMMARY]
    rows = [json.loads(x) for x in a.file(names.EVAL_EXAMPLES).read_text().splitlines()]
    assert len(rows) == 3 and {"prompt", "gold", "samples", "correct", "pass@1"} <= set(rows[0])
    assert {"completion", "extracted", "correct", "unparsable", "truncated"} <= set(rows[0]["samples"][0])
    s = json.loads(a.file(names.EVAL_SUMMARY).read_text())
    lo, hi = stats.wilson(sum(r["correct"] for r in rows), 3)
    assert s["accuracy_ci95"] == [lo, hi] and s["policy"]["weights"] == "nvfp4-dequantized"
    b = evaluate.evaluate(packed / "packed", gsm, tmp_path / "p", num_examples=3, max_new_tokens=6, progress=False)
    rb = [json.loads(x) for x in b.file(names.EVAL_EXAMPLES).read_text().splitlines()]
    # the packed model and the dequantized checkpoint are the same function: same greedy completions
    assert [r["samples"][0]["completion"] for r in rb] == [r["samples"][0]["completion"] for r in rows]
    k = evaluate.evaluate(packed / "packed", gsm, tmp_path / "k", num_examples=2, samples=3, temperature=1.0,
                          max_new_tokens=4, progress=False)
    rk = [json.loads(x) for x in k.file(names.EVAL_EXAMPLES).read_text().splitlines()]
    assert all(len(r["samples"]) == 3 for r in rk) and "pass@3" in rk[0]
    assert json.loads(k.file(names.EVAL_SUMMARY).read_text())["policy"]["sampling_seed"] == k.config["seed"]
    # how the batches' seeds follow from seed is part of the key (session 28 changed it: older evals recompute)
    assert "sha256(f'{seed}:sample:{b}')" in k.config["seeds"]


def test_report_compares_and_refuses_different_datasets(packed, tmp_path):
    kw = dict(num_examples=3, max_new_tokens=6, progress=False)
    a = evaluate.evaluate(packed / "packed", "arith:3", tmp_path / "a", **kw)
    b = evaluate.evaluate(packed / "quant", "arith:3", tmp_path / "b", **kw)
    r = report.report([a.path, b.path], tmp_path / "rep")
    data = json.loads(r.file(names.REPORT_JSON).read_text())
    assert len(data["evals"]) == 2 and data["paired"][0]["shared_examples"] == 3
    md = r.file(names.REPORT_MD).read_text()
    assert "McNemar" in md and "Answers checked by: qerl.parse_number 3." in md
    # the policy each eval declares, in the table: packed weights verified, greedy, 6 new tokens at most
    ra, rb = data["evals"]
    assert (ra["weights"], ra["verify"], ra["top_p"], ra["max_new_tokens"]) == ("nvfp4-packed", "verified", 1.0, 6)
    assert (rb["weights"], rb["verify"]) == ("nvfp4-dequantized", "n/a")
    s = evaluate.evaluate(packed / "packed", "arith:3", tmp_path / "s", skip_verify=True, **kw)
    r2 = report.report([a.path, s.path], tmp_path / "rep-s")
    assert json.loads(r2.file(names.REPORT_JSON).read_text())["evals"][1]["verify"] == "SKIPPED"
    assert "| SKIPPED |" in r2.file(names.REPORT_MD).read_text()
    c = evaluate.evaluate(packed / "packed", str(SHARED_DATA / "gsm8k" / "test.jsonl"), tmp_path / "c", **kw)
    with pytest.raises(QerlError, match="different datasets"):
        report.report([a.path, c.path], tmp_path / "rep2")
    res = run_cli("report", str(a.path), str(c.path), "-o", str(tmp_path / "rep3"))
    assert res.returncode == 1 and res.stderr.startswith("error:") and "Traceback" not in res.stderr


@pytest.mark.parametrize("k,n,lo,hi", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (10, 10, 0.7225, 1.0),
                                       (1, 20, 0.0089, 0.2361)])
def test_wilson_known_values(k, n, lo, hi):
    a, b = stats.wilson(k, n)
    assert a == pytest.approx(lo, abs=1e-4) and b == pytest.approx(hi, abs=1e-4)


def test_mcnemar_and_pass_at_k():
    assert stats.mcnemar_exact(0, 5) == pytest.approx(0.0625)
    assert stats.mcnemar_exact(3, 3) == 1.0
    assert stats.mcnemar_exact(10, 2) == pytest.approx(0.03857421875)
    assert stats.pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert stats.pass_at_k(10, 3, 2) == pytest.approx(1 - (7 * 6) / (10 * 9))
    with pytest.raises(ValueError, match="k <= n"):  # (it said 1.0 for k > n, even with nothing right)
        stats.pass_at_k(2, 0, 3)


@pytest.mark.parametrize("sigma", ["nan", "inf", "-1"])
def test_sigma_must_be_finite(packed, tmp_path, sigma):
    with pytest.raises(QerlError, match="sigma must be a finite number"):
        evaluate.evaluate(packed / "packed", "arith:2", tmp_path / "e", sigma=float(sigma), progress=False)
    from qerl_cli import rollout
    with pytest.raises(QerlError, match="sigma must be a finite number"):
        rollout.rollout(packed / "packed", "arith:1", tmp_path / "r", sigma=float(sigma), progress=False)
    assert not (tmp_path / "e").exists() and not (tmp_path / "r").exists()


def _fake_run(path, accuracies, step_s=10.0):
    """A run artifact with given per-step training accuracies (the report only reads metrics.jsonl)."""
    from qerl_cli import artifact

    path.mkdir()
    with open(path / names.RUN_METRICS, "w") as f:
        for i, a in enumerate(accuracies):
            f.write(json.dumps({"step": i + 1, "accuracy": a, "reward_mean": a, "informative_fraction": 0.5,
                                "entropy": 1.0 - 0.1 * i, "time_step_s": step_s, "peak_rss_bytes": 2**30,
                                "peak_mem_allocated_bytes": 0}) + "\n")
    artifact.write_manifest(path, names.KIND_RUN, {"steps": len(accuracies)}, [], "sha256:" + "0" * 64, {})
    return path


def test_report_on_runs_time_to_target_and_curves(tmp_path):
    a = _fake_run(tmp_path / "run-a", [0.1, 0.4, 0.65, 0.7])
    b = _fake_run(tmp_path / "run-b", [0.1, 0.2, 0.3], step_s=5.0)
    r = report.report([a, b], tmp_path / "rep", target_accuracy=0.6)
    data = json.loads(r.file(names.REPORT_JSON).read_text())
    ra, rb = data["runs"]
    assert ra["time_to_target"] == {"reached": True, "step": 3, "time_s": 30.0, "metric": "accuracy"}
    assert rb["time_to_target"] == {"reached": False, "metric": "accuracy"}  # never extrapolated
    assert ra["best_accuracy"] == 0.7 and rb["time_s"] == 15.0
    png = r.file(names.REPORT_CURVES).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    md = r.file(names.REPORT_MD).read_text()
    assert "step 3, 30 s (accuracy)" in md and "not reached within budget (accuracy)" in md


def test_report_key_follows_the_order_and_places_of_its_inputs(tmp_path, monkeypatch):
    """(review, session 31) The report's key held its inputs' digests as a set and the first path as typed: the same
    runs in another order (another baseline, other row order) or under other directory names (other arms) were
    served the old report, while the same command with relative paths was refused as a different artifact."""
    import shutil

    a = _fake_run(tmp_path / "run-a", [0.1, 0.4])
    b = _fake_run(tmp_path / "run-b", [0.2, 0.3])
    r = report.report([a, b], tmp_path / "rep")
    with pytest.raises(QerlError, match="different 'report' artifact"):
        report.report([b, a], tmp_path / "rep")
    shutil.copytree(a, tmp_path / "run-c")
    with pytest.raises(QerlError, match="different 'report' artifact"):
        report.report([tmp_path / "run-c", b], tmp_path / "rep")
    monkeypatch.chdir(tmp_path)
    assert report.report([Path("run-a"), Path("run-b")], Path("rep")).digest == r.digest  # (a cache hit)
    swapped = report.report([b, a], tmp_path / "rep-ba")
    assert [row["path"] for row in json.loads(swapped.file(names.REPORT_JSON).read_text())["runs"]] == [str(b), str(a)]


def _heldout_run(path, first, steps, step_s=7.0):
    """A run artifact whose metrics hold a step-0 held-out evaluation and (train accuracy, held-out or None) per
    step."""
    path.mkdir(parents=True)
    lines = [{"step": 0, "time_elapsed_s": 0.0, "heldout_accuracy": first, "heldout_ci95": [0.2, 0.4], "heldout_n": 100}]
    for i, (train_acc, held) in enumerate(steps):
        m = {"step": i + 1, "accuracy": train_acc, "reward_mean": train_acc, "informative_fraction": 0.5,
             "entropy": 0.5, "time_step_s": step_s, "time_elapsed_s": step_s * (i + 1), "peak_rss_bytes": 2**30,
             "peak_mem_allocated_bytes": 2**31, "time_rollout_s": 4.0, "time_logprobs_s": 1.0,
             "time_backward_s": 1.5, "time_optimizer_s": 0.1}
        if held is not None:
            m |= {"heldout_accuracy": held, "heldout_ci95": [held - 0.1, held + 0.1], "heldout_n": 100,
                  "time_eval_s": 50.0}
        lines.append(m)
    (path / names.RUN_METRICS).write_text("".join(json.dumps(m) + "\n" for m in lines))
    key = "sha256:" + hashlib.sha256(str(path).encode()).hexdigest()
    artifact.write_manifest(path, names.KIND_RUN, {"steps": len(steps)}, [], key, {})
    return path


def test_report_summarizes_arms_over_seeds(tmp_path):
    """Runs laid out as <arm>-s<seed>/run (examples/matrix) are summarized per arm: final held-out accuracy
    mean ± sample sd with the per-seed values, and each seed's time to target (a miss stays a miss)."""
    a0 = _heldout_run(tmp_path / "aqn-s0" / "run", 0.1, [(0.5, 0.7), (0.6, 0.8)])
    a1 = _heldout_run(tmp_path / "aqn-s1" / "run", 0.1, [(0.5, 0.4), (0.6, 0.5)])
    b0 = _heldout_run(tmp_path / "bf16-s0" / "run", 0.1, [(0.5, 0.9), (0.6, 0.95)], step_s=5.0)
    r = report.report([a0, a1, b0], tmp_path / "rep", target_accuracy=0.6)
    arms = {a["arm"]: a for a in json.loads(r.file(names.REPORT_JSON).read_text())["arms"]}
    assert set(arms) == {"aqn", "bf16"} and arms["aqn"]["seeds"] == [0, 1]
    assert arms["aqn"]["heldout_final"] == [0.8, 0.5]
    assert arms["aqn"]["heldout_final_mean"] == pytest.approx(0.65)
    assert arms["aqn"]["heldout_final_sd"] == pytest.approx(0.212132, rel=1e-5)
    assert arms["aqn"]["time_to_target_s"] == [7.0, "not reached within budget"] and arms["aqn"]["reached"] == 1
    assert arms["bf16"]["heldout_final_sd"] is None and arms["bf16"]["time_to_target_s"] == [5.0]
    md = r.file(names.REPORT_MD).read_text()
    assert "0.650 ± 0.212 (0.800, 0.500)" in md and "7 s, not reached within budget" in md


def test_report_time_to_target_uses_heldout_accuracy(tmp_path):
    """With held-out evaluations in the run, the target is judged on them (at the training time of their step,
    evaluation time excluded), not on the accuracy of the training samples."""
    path = _heldout_run(tmp_path / "run-h", 0.3, [(0.7, None), (0.8, 0.5), (0.8, None), (0.9, 0.62)])
    r = report.report([path], tmp_path / "rep", target_accuracy=0.6)
    (row,) = json.loads(r.file(names.REPORT_JSON).read_text())["runs"]
    assert row["time_to_target"] == {"reached": True, "step": 4, "time_s": 28.0, "metric": "heldout_accuracy"}
    assert row["steps"] == 4 and row["time_s"] == 28.0
    assert row["heldout"]["first"] == 0.3 and row["heldout"]["final"] == 0.62 and row["heldout"]["best"] == 0.62
    assert row["curves"]["heldout_accuracy"] == [[0.0, 0.3], [14.0, 0.5], [28.0, 0.62]]
    assert row["mean_phase_time_s"]["rollout"] == 4.0
    md = r.file(names.REPORT_MD).read_text()
    assert "0.300 → 0.620" in md and "step 4, 28 s" in md


def test_accuracy_ci_binary_is_wilson_and_mean_at_k_is_not_overconfident():
    """One sample per example: the Wilson interval over examples. k samples per example: Wilson at the
    effective sample size n_eff = p(1-p)n/s^2 clamped to [n, nk]. With perfectly correlated samples (each
    example all right or all wrong) it is Wilson over the n examples, twice as wide as the naive one."""
    binary = [True] * 30 + [False] * 10
    (lo, hi), method = stats.accuracy_ci(binary)
    assert (lo, hi) == stats.wilson(30, 40) and method.startswith("Wilson")
    assert stats.accuracy_ci([1.0] * 30 + [0.0] * 10, k=1)[0] == stats.wilson(30, 40)  # k = 1: exactly Wilson
    assert stats.accuracy_ci([True] + [False] * 39, k=1)[0] == stats.wilson(1, 40)
    scores = [1.0] * 128 + [0.0] * 128  # k = 4, every example 4/4 or 0/4
    (lo, hi), method = stats.accuracy_ci(scores, k=4)
    nl, nh = stats.wilson(512, 1024)
    assert "effective sample size" in method and (lo, hi) == stats.wilson(128, 256)
    assert (hi - lo) > 1.9 * (nh - nl)
    # no spread between examples with 0 < p < 1: the samples are independent, n*k of them
    assert stats.accuracy_ci([0.75] * 50, k=4)[0] == pytest.approx(stats.wilson(150, 200))


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_mean_at_k_interval_never_collapses_at_the_edges(p):
    """All-0 / all-1 per-example scores: the correlation of an example's samples cannot be estimated, so the
    interval is Wilson over the n examples (positive width, the conservative choice), not [p, p]."""
    (lo, hi), _ = stats.accuracy_ci([p] * 40, k=4)
    assert hi - lo > 0.08 and (lo, hi) == stats.wilson(40 * p, 40)


def test_mean_at_k_interval_known_values():
    # scores 0, 1/4, 2/4, 3/4 (k = 4): p = 0.375, s^2 = 0.3125 / 3, n_eff = p(1-p) * 4 / s^2 = 9 (within [4, 16])
    assert stats.effective_sample_size([0.0, 0.25, 0.5, 0.75], 4) == pytest.approx(9.0)
    (lo, hi), _ = stats.accuracy_ci([0.0, 0.25, 0.5, 0.75], k=4)
    assert lo == pytest.approx(0.14497, abs=1e-5) and hi == pytest.approx(0.67981, abs=1e-5)  # Wilson(3.375, 9)
    # one example with 1 of 4 right among 40 (the bootstrap gave [0, 0.019]): n_eff = 159, above the mean
    (lo, hi), _ = stats.accuracy_ci([0.25] + [0.0] * 39, k=4)
    assert lo == pytest.approx(0.0010993, abs=1e-6) and hi == pytest.approx(0.034696, abs=1e-5)
    assert stats.effective_sample_size([0.25] + [0.0] * 39, 4) == pytest.approx(159.0)
    # clamps: s^2 larger than binomial over n -> n; n_eff above n*k -> n*k
    assert stats.effective_sample_size([0.0, 1.0], 8) == 2.0


def _fake_eval(path, scores, k=4):
    """An eval artifact with given per-example scores (mean@k floats, or bools for k = 1)."""
    path.mkdir(parents=True)
    (path / names.EVAL_EXAMPLES).write_text("".join(json.dumps({"index": i, "correct": s}) + "\n"
                                                    for i, s in enumerate(scores)))
    acc = sum(map(float, scores)) / len(scores)
    (path / names.EVAL_SUMMARY).write_text(json.dumps({
        "dataset": "arith:4", "dataset_id": "sha256:arith4", "examples": len(scores), "samples_per_example": k,
        "accuracy": acc, "accuracy_ci95": [acc - 0.001, acc + 0.001], "generated_tokens": 10,
        "policy": {"weights": "bfloat16", "temperature": 1.0, "aqn": {"sigma": 0.0}}}))
    key = "sha256:" + hashlib.sha256(str(path).encode()).hexdigest()
    artifact.write_manifest(path, names.KIND_EVAL, {}, [], key, {})
    return path


def test_report_mean_at_k_pairs_and_arms_over_seeds(tmp_path):
    """mean@k evals: no McNemar (no single right/wrong per example; said so, not a 0/0 'nan'), the interval is
    recomputed from the examples whatever the summary says, and evals laid out <arm>-s<seed>/eval are pooled
    per arm (each example averaged over seeds) and compared to the first arm with a paired bootstrap."""
    b0 = _fake_eval(tmp_path / "bf16-s0" / "eval", [1.0, 1.0, 0.5, 0.0])
    b1 = _fake_eval(tmp_path / "bf16-s1" / "eval", [1.0, 0.5, 0.5, 0.0])
    q0 = _fake_eval(tmp_path / "nvfp4-s0" / "eval", [0.5, 0.5, 0.0, 0.0])
    q1 = _fake_eval(tmp_path / "nvfp4-s1" / "eval", [0.5, 0.0, 0.0, 0.0])
    r = report.report([b0, b1, q0, q1], tmp_path / "rep")
    data = json.loads(r.file(names.REPORT_JSON).read_text())
    assert all("mcnemar_exact_p" not in p for p in data["paired"])
    assert data["evals"][0]["ci95"] != [0.624, 0.626] and "effective sample size" in data["evals"][0]["ci_method"]
    assert data["evals"][0]["ci95"] == list(stats.accuracy_ci([1.0, 1.0, 0.5, 0.0], k=4)[0])
    arms = {a["arm"]: a for a in data["arm_evals"]}
    assert arms["bf16"]["accuracy"] == pytest.approx(0.5625) and arms["bf16"]["per_seed"] == [0.625, 0.5]
    assert arms["nvfp4"]["vs"] == "bf16" and arms["nvfp4"]["seeds"] == [0, 1]
    assert arms["nvfp4"]["paired_bootstrap"]["mean_diff"] == pytest.approx(0.1875 - 0.5625)
    md = r.file(names.REPORT_MD).read_text()
    assert "n/a (mean@k)" in md and "| nvfp4 | 0, 1 | 4 | 0.1875 |" in md and "nan" not in md
    # one sample per example: McNemar is there
    x = _fake_eval(tmp_path / "x" / "eval", [True, True, False, False], k=1)
    y = _fake_eval(tmp_path / "y" / "eval", [False, True, False, True], k=1)
    (p,) = json.loads(report.report([x, y], tmp_path / "rep2").file(names.REPORT_JSON).read_text())["paired"]
    assert (p["baseline_only_correct"], p["other_only_correct"], p["mcnemar_exact_p"]) == (1, 1, 1.0)


def test_report_says_why_mcnemar_is_missing_for_repeated_prompts(tmp_path):
    """k = 1 evals whose set repeats a prompt (arith:N does) get no McNemar; the report said "n/a (mean@k)",
    a wrong reason for one sample per example (helper review, session 31)."""
    x = _fake_eval(tmp_path / "x", [True, True, False, False], k=1)
    y = _fake_eval(tmp_path / "y", [False, True, False, True], k=1)
    for d in (x, y):  # prompts 0 and 1 are the same question
        rows = [json.loads(line) for line in (d / names.EVAL_EXAMPLES).read_text().splitlines()]
        for r in rows:
            r["prompt"] = "q0" if r["index"] < 2 else f"q{r['index']}"
        (d / names.EVAL_EXAMPLES).write_text("".join(json.dumps(r) + "\n" for r in rows))
        m = json.loads((d / names.MANIFEST).read_text())
        artifact.write_manifest(d, names.KIND_EVAL, {}, [], m["key"], {})
    r = report.report([x, y], tmp_path / "rep")
    (p,) = json.loads(r.file(names.REPORT_JSON).read_text())["paired"]
    assert "mcnemar_exact_p" not in p
    md = r.file(names.REPORT_MD).read_text()
    assert "mean@k" not in md and "n/a (repeated prompts)" in md


def test_num_examples_truncates_generated_task(packed, tmp_path):
    a = evaluate.evaluate(packed / "packed", "arith:20", tmp_path / "e", num_examples=2, max_new_tokens=2,
                          progress=False)
    s = json.loads(a.file(names.EVAL_SUMMARY).read_text())
    assert s["examples"] == 2 and len(a.file(names.EVAL_EXAMPLES).read_text().splitlines()) == 2


def test_answer_checker_is_recorded_in_eval(packed, tmp_path, monkeypatch):
    from qerl_cli import tasks

    kw = dict(num_examples=2, max_new_tokens=2, progress=False)
    a = evaluate.evaluate(packed / "packed", "arith:2", tmp_path / "a", **kw)
    assert a.config["verifier"]["checker"] == tasks.NUMERIC_CHECKER
    assert json.loads(a.file(names.EVAL_SUMMARY).read_text())["verifier"] == a.config["verifier"]
    monkeypatch.setattr(tasks, "_math_verify", lambda: (str.strip, lambda g, p: g == p, "9.9.9"))
    b = evaluate.evaluate(packed / "packed", "arith:2", tmp_path / "b", **kw)
    assert json.loads(b.file(names.EVAL_SUMMARY).read_text())["verifier"]["checker"] == {
        "name": "math-verify", "version": "9.9.9"}
    assert b.key != a.key
    # (review, session 26) report paired evals scored by different checkers as if "correct" meant the same
    with pytest.raises(QerlError, match=r"different answer checkers.*qerl.parse_number 3.*math-verify 9.9.9"):
        report.report([a.path, b.path], tmp_path / "rep")
    assert not (tmp_path / "rep").exists()


def test_paths_and_messages_print_as_written(packed, tmp_path):
    """(review, session 27) An output path with markup brackets crashed the table after the artifact was
    written, and ":x:" in an error sentence printed as an emoji."""
    out = tmp_path / "ev[/x]"
    r = run_cli("evaluate", str(packed / "packed"), "--data", "arith:2", "-n", "1", "--max-new-tokens", "2",
                "--no-progress", "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert str(out) in r.stdout and (out / names.MANIFEST).is_file()
    r = run_cli("evaluate", str(packed / "packed"), "--data", "arith:x", "--no-progress", "-o", str(tmp_path / "e"))
    assert r.returncode == 1 and "arith:x" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_cluster_effective_size_known_values():
    # ten prompts asked five times each, every repeat answered alike: worth ten trials, not fifty
    assert stats.cluster_effective_size([5] * 5 + [0] * 5, [5] * 10) == pytest.approx(10)
    # independent-looking repeats (within-cluster spread like the whole): close to every trial
    assert stats.cluster_effective_size([2, 3, 2, 3, 3, 2, 2, 3, 2, 3], [5] * 10) == 50
    # unequal clusters: p = 0.1, Var(p) = 3/2 * (0.8^2 + 0.1^2 + 0.9^2) / 10^2
    assert stats.cluster_effective_size([0, 0, 1], [8, 1, 1]) == pytest.approx(0.09 / (1.5 * 1.46 / 100))
    # none right: the correlation cannot be estimated, the Kish size (sum m)^2 / sum m^2 (below 3 clusters)
    assert stats.cluster_effective_size([0, 0, 0], [8, 1, 1]) == pytest.approx(100 / 66)
    # one trial per cluster: as before (Wilson over n)
    scores = [1, 0, 0, 1, 1, 0, 1, 0, 0, 0]
    assert stats.accuracy_ci(scores, 1, clusters=list(range(10))) == stats.accuracy_ci(scores, 1)
    assert stats.accuracy_ci(scores, 1)[0] == stats.wilson(4, 10)


def test_repeated_prompts_are_one_cluster():
    """(review, session 27) arith:N repeats held-out questions; greedy answers to a repeat are copies, so the
    interval, the paired bootstrap and McNemar must not count them as new examples."""
    scores = [1.0] * 25 + [0.0] * 25  # five prompts of ten repeats each, all alike
    prompts = [i // 10 for i in range(50)]
    (lo, hi), method = stats.accuracy_ci(scores, 1, clusters=prompts)
    assert "5 distinct prompts" in method
    n_eff = stats.cluster_effective_size([10, 10, 5, 0, 0], [10] * 5)
    assert (lo, hi) == stats._wilson_at(0.5, n_eff) and hi - lo > 2 * (lambda t: t[1] - t[0])(stats.wilson(25, 50))
    a = [0.0] * 50
    b = [1.0] * 20 + [0.0] * 30  # the other policy gets two of the five prompts right
    plain = stats.paired_bootstrap(a, b)["ci95"]
    clustered = stats.paired_bootstrap(a, b, clusters=prompts)["ci95"]
    assert clustered[1] - clustered[0] > 2 * (plain[1] - plain[0])
    with pytest.raises(ValueError, match="cluster keys"):
        stats.paired_bootstrap(a, b, clusters=prompts[:-1])


def test_eval_of_repeated_prompts_clusters_them(packed, tmp_path):
    kw = dict(max_new_tokens=2, progress=False)
    a = evaluate.evaluate(packed / "packed", "arith:60", tmp_path / "a", **kw)
    b = evaluate.evaluate(packed / "quant", "arith:60", tmp_path / "b", **kw)
    rows = [json.loads(x) for x in a.file(names.EVAL_EXAMPLES).read_text().splitlines()]
    prompts = [r["prompt"] for r in rows]
    s = json.loads(a.file(names.EVAL_SUMMARY).read_text())
    assert s["examples"] == 60 and s["distinct_prompts"] == len(set(prompts)) < 60  # the task repeats questions
    ci, method = stats.accuracy_ci([r["correct"] for r in rows], 1, clusters=prompts)
    assert s["accuracy_ci95"] == list(ci) and s["ci_method"] == method
    assert list(ci) != list(stats.wilson(sum(r["correct"] for r in rows), 60))
    rep = json.loads(report.report([a.path, b.path], tmp_path / "rep").file(names.REPORT_JSON).read_text())
    assert rep["evals"][0]["ci95"] == list(ci)
    pair = rep["paired"][0]
    assert pair["distinct_prompts"] == s["distinct_prompts"] and "mcnemar_exact_p" not in pair


def test_aqn_at_evaluation_is_applied_and_recorded(packed, tmp_path):
    kw = dict(num_examples=4, max_new_tokens=8, progress=False)
    clean = evaluate.evaluate(packed / "packed", "arith:4", tmp_path / "clean", **kw)
    noisy = evaluate.evaluate(packed / "packed", "arith:4", tmp_path / "noisy", sigma=2.0, seed=3, **kw)

    def completions(a):
        return [json.loads(x)["samples"][0]["completion"] for x in a.file(names.EVAL_EXAMPLES).read_text().splitlines()]

    assert completions(clean) != completions(noisy)  # the noise reached the policy that generates
    assert json.loads(noisy.file(names.EVAL_SUMMARY).read_text())["policy"]["aqn"] == {"sigma": 2.0, "seed": 3}


def test_greedy_eval_ignores_seed_and_top_p_in_its_key(packed, tmp_path, monkeypatch):
    """(review-b) greedy without AQN draws nothing: --seed and --top-p do not change a token, so changing them
    must neither recompute nor refuse the output as "a different artifact"; under sampling they still count."""
    from qerl_cli import packed_model

    kw = dict(num_examples=2, max_new_tokens=2, progress=False)
    a = evaluate.evaluate(packed / "packed", "arith:2", tmp_path / "g", seed=0, **kw)
    real_load = packed_model.load_packed_model
    monkeypatch.setattr(packed_model, "load_packed_model", lambda *a, **k: pytest.fail("greedy rerun recomputed"))
    assert evaluate.evaluate(packed / "packed", "arith:2", tmp_path / "g", seed=7, top_p=0.5, **kw).digest == a.digest
    monkeypatch.setattr(packed_model, "load_packed_model", real_load)
    s1 = evaluate.evaluate(packed / "packed", "arith:2", tmp_path / "s1", seed=0, temperature=1.0, **kw)
    s2 = evaluate.evaluate(packed / "packed", "arith:2", tmp_path / "s2", seed=7, temperature=1.0, **kw)
    n1 = evaluate.evaluate(packed / "packed", "arith:2", tmp_path / "n1", seed=7, sigma=0.01, **kw)
    assert len({a.key, s1.key, s2.key, n1.key}) == 4  # sampling or AQN: the seed is part of the policy


def test_paired_interval_never_collapses():
    """(review-b) the percentile bootstrap of a paired difference collapsed to zero width wherever every example
    differs alike: two evals that agree on all 50 examples got "+0.000 [+0.000, +0.000]" (certainty of no
    difference), three flipped examples "+1.000 [+1.000, +1.000]" (exact McNemar p = 0.25). The interval is never
    narrower than Newcombe's for paired proportions (Wilson intervals of both arms, their correlation)."""
    same = [1.0] * 10 + [0.0] * 40
    lo, hi = stats.paired_bootstrap(same, same)["ci95"]
    assert lo < 0 < hi and hi - lo > 0.05
    # (review, session 34) at p = 1/2 the plain correlation (1) still collapsed it: Newcombe's corrected one,
    # whose interval for two identical evals of 50 at p = 1/2 is +-0.0378 (Fagerland et al.'s implementation)
    half = [1.0] * 25 + [0.0] * 25
    assert stats._newcombe_paired(half, half) == pytest.approx((-0.0378, 0.0378), abs=1e-4)
    lo, hi = stats.paired_bootstrap(half, half)["ci95"]
    assert lo <= -0.0378 + 1e-4 and hi >= 0.0378 - 1e-4
    # Fagerland et al.'s worked example (a 2x2 table of 59 / 6 / 16 / 80): Newcombe's interval (-0.1186, -0.0046)
    a = [1.0] * 59 + [0.0] * 6 + [1.0] * 16 + [0.0] * 80
    b = [1.0] * 59 + [1.0] * 6 + [0.0] * 16 + [0.0] * 80
    assert stats._newcombe_paired(a, b) == pytest.approx((-0.11862, -0.00463), abs=1e-5)
    lo, hi = stats.paired_bootstrap([0.0] * 3, [1.0] * 3)["ci95"]
    assert lo < 0.7 and hi == 1.0
    lo, hi = stats.paired_bootstrap([0.0] * 50, [0.0] * 49 + [1.0])["ci95"]
    assert lo < 0 < 0.02 < hi
    # a large set with an even spread of discordant pairs: about the bootstrap's own interval
    a = [1.0, 0.0, 1.0, 0.0] * 100
    b = [1.0, 1.0, 0.0, 1.0] * 100
    lo, hi = stats.paired_bootstrap(a, b)["ci95"]
    assert abs((hi - lo) - 2 * 1.96 * (statistics.pstdev([y - x for x, y in zip(a, b)]) / 20)) < 0.02


def test_eval_key_holds_the_problems_selected_not_the_options_as_typed(packed, tmp_path, monkeypatch):
    """(review-c) --num-examples 4 and 0 (= all) on a 4-problem set, or another --split (config) for a local file
    or the generated task (which read no split), evaluate the same problems (the data input's digest holds them):
    one eval, a cache hit that loads no model, never "a different artifact" (rollout does so since session 30)."""
    from qerl_cli import packed_model

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": f"#### {i + 1}"}) + "\n"
                         for i in range(3)))
    other_split = tmp_path / "split.toml"
    other_split.write_text('split = "train"\n')
    kw = dict(max_new_tokens=2, progress=False)
    a = evaluate.evaluate(packed / "packed", "arith:4", tmp_path / "a", num_examples=4, **kw)
    b = evaluate.evaluate(packed / "packed", str(f), tmp_path / "b", **kw)
    monkeypatch.setattr(packed_model, "load_packed_model", lambda *a, **k: pytest.fail("an equal eval recomputed"))
    assert evaluate.evaluate(packed / "packed", "arith:4", tmp_path / "a", num_examples=0, **kw).digest == a.digest
    assert evaluate.evaluate(packed / "packed", "arith:4", tmp_path / "a", config_file=other_split, **kw
                             ).digest == a.digest
    assert evaluate.evaluate(packed / "packed", str(f), tmp_path / "b", num_examples=3, config_file=other_split,
                             **kw).digest == b.digest
    assert a.config["num_examples"] == 4 and b.config["num_examples"] == 3  # the count selected, recorded


def test_a_prompt_past_the_positions_is_refused_before_the_first_batch(packed, tmp_path, monkeypatch):
    """A prompt that leaves no room for the new tokens, in a later batch: one sentence before any batch is
    generated (it came after the earlier batches' work), and no output written."""
    from qerl_cli.engine import Engine

    f = tmp_path / "p.jsonl"
    rows = [{"question": "What is 1 + 1?", "answer": "#### 2"},
            {"question": "What is " + " + ".join(["1"] * 400) + "?", "answer": "#### 400"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tmp_path / "one.toml"
    cfg.write_text("batch_prompts = 1\n")
    calls = []
    real = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with pytest.raises(QerlError, match="max_position_embeddings"):
        evaluate.evaluate(packed / "packed", str(f), tmp_path / "e", max_new_tokens=4, config_file=cfg,
                          progress=False)
    assert calls == [] and not (tmp_path / "e").exists()
