"""``qerl report``: eval artifacts side by side (accuracy ± CI, paired test on shared examples, time, tokens,
memory) and, for train runs, learning curves as PNG plus a quality-vs-time-vs-memory table.
Markdown and JSON outputs."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from . import artifact, names, stats, ui
from .errors import QerlError


def _eval_rows(arts: list[artifact.Artifact]) -> tuple[list[dict], list[dict], list[dict]]:
    summaries = [json.loads(a.file(names.EVAL_SUMMARY).read_text()) for a in arts]
    ids = {s["dataset_id"] for s in summaries}
    if len(ids) > 1:
        names_ = ", ".join(f"{a.path} ({s['dataset']}, {s['examples']} examples)" for a, s in zip(arts, summaries))
        raise QerlError(f"these eval artifacts evaluated different datasets, so they do not compare: {names_}.")
    checkers = {json.dumps(s.get("verifier"), sort_keys=True) for s in summaries}
    if len(checkers) > 1:  # a different answer checker changes what "correct" means (review, session 26)
        names_ = ", ".join(f"{a.path} ({_checker(s.get('verifier'))})" for a, s in zip(arts, summaries))
        raise QerlError(f"these eval artifacts were scored by different answer checkers, so their accuracies do not "
                        f"compare: {names_}; evaluate them again with the same checker installed.")
    examples = []
    for a in arts:
        ex = {}
        for line in a.file(names.EVAL_EXAMPLES).read_text().splitlines():
            e = json.loads(line)
            ex[e["index"]] = e
        examples.append(ex)
    rows = []
    for a, s, ex in zip(arts, summaries, examples):
        p = s["policy"]
        # the interval is recomputed from the per-example scores, so every row uses the same method (older
        # artifacts hold a Wilson interval over all n*k samples, or a percentile bootstrap that collapses at
        # all-0/all-1 scores, in the summary)
        ci, ci_method = stats.accuracy_ci([e["correct"] for e in ex.values()], k=s.get("samples_per_example", 1),
                                          clusters=[_prompt(e, i) for i, e in ex.items()])
        rows.append({"path": str(a.path), "weights": p.get("weights"), "adapter": (p.get("adapter_digest") or "none")[:12],
                     "temperature": p.get("temperature"), "top_p": p.get("top_p"),
                     "max_new_tokens": p.get("max_new_tokens"), "aqn_sigma": p.get("aqn", {}).get("sigma"),
                     "verify": _verify_state(p), "verifier": s.get("verifier"),
                     "samples_per_example": s.get("samples_per_example", 1),
                     "examples": s["examples"], "accuracy": s["accuracy"], "ci95": list(ci), "ci_method": ci_method,
                     "generated_tokens": s["generated_tokens"], "wall_s": a.metrics.get("wall_s"),
                     "peak_rss_bytes": a.metrics.get("peak_rss_bytes"),
                     "peak_cuda_bytes": a.metrics.get("peak_cuda_allocated") or a.metrics.get("peak_cuda_bytes")})
    paired = []
    base = examples[0]
    for a, ex in zip(arts[1:], examples[1:]):
        shared = sorted(set(base) & set(ex))
        x = [float(base[i]["correct"]) for i in shared]
        y = [float(ex[i]["correct"]) for i in shared]
        prompts = [_prompt(base[i], i) for i in shared]
        entry = {"baseline": str(arts[0].path), "other": str(a.path), "shared_examples": len(shared),
                 "distinct_prompts": len(set(prompts))}
        # McNemar needs one right/wrong outcome per independent example; mean@k scores (k > 1) and sets that
        # repeat a prompt (repeats are not independent) get the paired bootstrap only, resampling prompts whole
        if len(set(prompts)) == len(prompts) and all(isinstance(base[i]["correct"], bool)
                                                    and isinstance(ex[i]["correct"], bool) for i in shared):
            b = sum(1 for i in shared if base[i]["correct"] and not ex[i]["correct"])
            c = sum(1 for i in shared if not base[i]["correct"] and ex[i]["correct"])
            entry.update(baseline_only_correct=b, other_only_correct=c, mcnemar_exact_p=stats.mcnemar_exact(b, c))
        entry["paired_bootstrap"] = stats.paired_bootstrap(x, y, clusters=prompts) if shared else None
        paired.append(entry)
    return rows, paired, examples


def _prompt(example: dict, index) -> object:
    """An example's prompt, its cluster key (examples with one prompt are not independent); an example without
    a recorded prompt is its own cluster."""
    return example.get("prompt", ("example", index))


def _checker(verifier: dict | None) -> str:
    """The answer checker of a recorded verifier, as ``name version`` ("not recorded" for older artifacts)."""
    c = (verifier or {}).get("checker")
    return f"{c.get('name')} {c.get('version')}" if isinstance(c, dict) else "not recorded"


def _verify_state(policy: dict) -> str:
    """How the evaluated weights were checked: "verified" (a verify artifact's digest), "SKIPPED" (a packed model
    evaluated with --skip-verify) or "n/a" (bf16 / fp32 source weights: nothing to verify)."""
    v = policy.get("verify")
    if v is None:
        return "n/a"
    return "SKIPPED" if str(v).startswith("skipped") else "verified"


def _arm_evals(arts: list[artifact.Artifact], examples: list[dict]) -> list[dict]:
    """Eval artifacts of arms over seeds (laid out ``<arm>-s<seed>/eval``, as examples/matrix does): per arm,
    each example's score averaged over the arm's seeds, then a paired bootstrap over the shared examples against
    the first arm. It measures the evaluation's sampling noise on shared problems; the spread between training
    seeds is the separate per-seed column."""
    arms: dict[str, list[tuple[int, dict]]] = {}
    for a, ex in zip(arts, examples):
        key = _arm_of(str(a.path))
        if key is not None:
            arms.setdefault(key[0], []).append((key[1], ex))
    if len(arms) < 2:
        return []
    pooled, prompt_of = {}, {}
    for arm, seeds in arms.items():
        shared = set.intersection(*(set(ex) for _, ex in seeds))
        pooled[arm] = ({i: sum(float(ex[i]["correct"]) for _, ex in seeds) / len(seeds) for i in shared},
                       sorted(s for s, _ in seeds))
        prompt_of.update((i, _prompt(e, i)) for _, ex in seeds for i, e in ex.items())
    order = list(arms)  # first appearance in the arguments
    base_arm = order[0]
    out = []
    for arm in order:
        scores, seeds = pooled[arm]
        row = {"arm": arm, "seeds": seeds, "examples": len(scores),
               "accuracy": sum(scores.values()) / len(scores) if scores else float("nan"),
               "per_seed": [sum(float(v["correct"]) for v in ex.values()) / len(ex) for _, ex in
                            sorted(arms[arm], key=lambda t: t[0])]}
        if arm != base_arm:
            shared = sorted(set(scores) & set(pooled[base_arm][0]))
            row["vs"] = base_arm
            row["paired_bootstrap"] = stats.paired_bootstrap([pooled[base_arm][0][i] for i in shared],
                                                             [scores[i] for i in shared],
                                                             clusters=[prompt_of[i] for i in shared]) if shared else None
        out.append(row)
    return out


def _markdown(rows: list[dict], paired: list[dict], arm_evals: list[dict]) -> str:
    out = ["| eval | weights | verify | adapter | T | top-p | max new | AQN σ | n | k | accuracy | 95% CI | tokens | "
           "wall s | peak RSS GiB |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['path']} | {r['weights']} | {r['verify']} | {r['adapter']} | {r['temperature']} | "
                   f"{r['top_p']} | {r['max_new_tokens']} | {r['aqn_sigma']} | "
                   f"{r['examples']} | {r['samples_per_example']} | {r['accuracy']:.4f} | "
                   f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] | "
                   f"{r['generated_tokens']} | {r['wall_s'] or 0:.1f} | {(r['peak_rss_bytes'] or 0) / 2**30:.2f} |")
    methods = sorted({r["ci_method"] for r in rows})
    out += ["", "Intervals: " + "; ".join(methods) + f". Answers checked by: {_checker(rows[0]['verifier'])}."]
    if paired:
        out += ["", "| vs baseline | shared | only baseline right | only other right | McNemar p "
                "| mean diff, other − baseline [95% CI] |",
                "|---|---|---|---|---|---|"]
        for p in paired:  # (why McNemar is missing: mean@k scores, or a set that repeats a prompt)
            dash = "n/a (repeated prompts)" if p["distinct_prompts"] < p["shared_examples"] else "n/a (mean@k)"
            bs = p["paired_bootstrap"]
            mc = f"{p['mcnemar_exact_p']:.4g}" if "mcnemar_exact_p" in p else dash
            out.append(f"| {p['other']} | {p['shared_examples']} | {p.get('baseline_only_correct', dash)} | "
                       f"{p.get('other_only_correct', dash)} | {mc} | "
                       f"{bs['mean_diff']:+.4f} [{bs['ci95'][0]:+.3f}, {bs['ci95'][1]:+.3f}] |")
    if arm_evals:
        out += ["", "Final adapters by arm (each example's score averaged over the arm's seeds; paired bootstrap over "
                "the shared examples against the first arm — evaluation noise only, the per-seed column shows the "
                "spread between training seeds):", "",
                "| arm | seeds | examples | accuracy | per seed | vs | mean diff, arm − vs [95% CI] |",
                "|---|---|---|---|---|---|---|"]
        for a in arm_evals:
            bs = a.get("paired_bootstrap")
            diff = f"{bs['mean_diff']:+.4f} [{bs['ci95'][0]:+.3f}, {bs['ci95'][1]:+.3f}]" if bs else "-"
            out.append(f"| {a['arm']} | {', '.join(map(str, a['seeds']))} | {a['examples']} | {a['accuracy']:.4f} | "
                       f"{', '.join(f'{x:.4f}' for x in a['per_seed'])} | {a.get('vs', '-')} | {diff} |")
    return "\n".join(out) + "\n"


CURVES = ("heldout_accuracy", "accuracy", "reward_mean", "informative_fraction", "entropy")
CURVE_TITLES = {"heldout_accuracy": "held-out accuracy (adapter on, AQN off)",
                "accuracy": "accuracy on the training samples", "reward_mean": "mean reward",
                "informative_fraction": "informative-group fraction", "entropy": "entropy (nats / token)"}


def _run_rows(arts: list[artifact.Artifact], target: float | None) -> list[dict]:
    rows = []
    for a in arts:
        lines = [json.loads(line) for line in a.file(names.RUN_METRICS).read_text().splitlines() if line.strip()]
        steps = [m for m in lines if "time_step_s" in m]  # training steps; a step-0 line holds only an evaluation
        if not steps:
            raise QerlError(f"{a.path} has no steps in {names.RUN_METRICS}.")
        t, at = 0.0, {}
        for m in lines:  # training time at the end of each line's step (evaluations not counted)
            t = m.get("time_elapsed_s", t + m.get("time_step_s", 0.0))
            at[id(m)] = t
        held = [m for m in lines if m.get("heldout_accuracy") is not None]
        # time to target: on held-out accuracy when the run evaluated it, else on the training samples
        metric = "heldout_accuracy" if held else "accuracy"
        reached = None
        if target is not None:
            reached = {"reached": False, "metric": metric}
            for m in (held or steps):
                if m[metric] >= target:
                    reached = {"reached": True, "step": m["step"], "time_s": at[id(m)], "metric": metric}
                    break
        peak_cuda = max(m.get("peak_mem_allocated_bytes", 0) or 0 for m in steps)
        peak_rss = max(m.get("peak_rss_bytes", 0) or 0 for m in steps)
        phases = {k: sum(m.get(f"time_{k}_s", 0.0) for m in steps) / len(steps)
                  for k in ("rollout", "logprobs", "backward", "optimizer", "step")}
        rows.append({"path": str(a.path), "steps": len(steps), "time_s": at[id(steps[-1])],
                     "final": {k: steps[-1].get(k) for k in CURVES if k != "heldout_accuracy"},
                     "best_accuracy": max(m.get("accuracy", 0.0) for m in steps),
                     "heldout": {"first": held[0]["heldout_accuracy"], "final": held[-1]["heldout_accuracy"],
                                 "final_ci95": held[-1].get("heldout_ci95"), "n": held[-1].get("heldout_n"),
                                 "best": max(m["heldout_accuracy"] for m in held)} if held else None,
                     "mean_phase_time_s": phases,
                     "peak_cuda_allocated_bytes": peak_cuda, "peak_rss_bytes": peak_rss,
                     "target_accuracy": target,
                     "time_to_target": reached,
                     "curves": {k: [[at[id(m)], m.get(k)] for m in (held if k == "heldout_accuracy" else steps)]
                                for k in CURVES}})
    return rows


def _label(path: str) -> str:
    """A short legend label: the last two path parts (``bf16-s0/run``)."""
    return "/".join(Path(path).parts[-2:])


def _plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise QerlError("plotting train curves needs matplotlib: pip install 'qerl[plot]'.") from None
    fig, axes = plt.subplots(2, 3, figsize=(15, 7))
    axes.flat[-1].axis("off")
    for ax, key in zip(axes.flat, CURVES):
        for r in rows:
            pts = [(x, y) for x, y in r["curves"][key] if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=_label(r["path"]))
        ax.set_title(CURVE_TITLES[key])
        ax.set_xlabel("training time (s)")
        ax.grid(alpha=0.3)
    labelled = [ax for ax in axes.flat if ax.get_lines()]
    if labelled:
        labelled[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _run_markdown(rows: list[dict]) -> str:
    out = ["| run | steps | train s | held-out acc first → final [95% CI] (best) | final train-sample acc | "
           "final entropy | informative | s/step: rollout / log-probs / backward / optimizer | peak CUDA GiB | "
           "time to target |", "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in rows:
        f, h, ph = r["final"], r["heldout"], r["mean_phase_time_s"]
        ttt = r["time_to_target"]
        ttt = "-" if ttt is None else (f"step {ttt['step']}, {ttt['time_s']:.0f} s ({ttt['metric']})" if ttt["reached"]
                                       else f"not reached within budget ({ttt['metric']})")
        held = (f"{h['first']:.3f} → {h['final']:.3f} [{h['final_ci95'][0]:.2f}, {h['final_ci95'][1]:.2f}] "
                f"({h['best']:.3f})" if h else "-")
        out.append(f"| {r['path']} | {r['steps']} | {r['time_s']:.0f} | {held} | {fmt(f['accuracy'])} | "
                   f"{fmt(f['entropy'])} | {fmt(f['informative_fraction'])} | {ph['rollout']:.2f} / "
                   f"{ph['logprobs']:.2f} / {ph['backward']:.2f} / {ph['optimizer']:.2f} | "
                   f"{r['peak_cuda_allocated_bytes'] / 2**30:.2f} | {ttt} |")
    note = ("Time to target is measured on held-out accuracy where the run evaluated it (`--eval-every`), else on "
            "the accuracy of the training samples; training time excludes evaluations.")
    return "\n".join(out) + f"\n\n{note}\n\nCurves: `curves.png` ({', '.join(CURVES)} vs training time).\n"


SEED_DIR = re.compile(r"^(?P<arm>.+)-s(?P<seed>\d+)$")


def _arm_of(path: str) -> tuple[str, int] | None:
    """(arm, seed) of a run laid out as ``<arm>-s<seed>/`` (or ``<arm>-s<seed>/run``), as examples/matrix does."""
    for part in reversed(Path(path).parts[-2:]):
        m = SEED_DIR.match(part)
        if m:
            return m["arm"], int(m["seed"])
    return None


def _arm_rows(run_rows: list[dict]) -> list[dict]:
    """Runs of one arm over several seeds, summarized: final and best held-out accuracy (mean, sample std,
    per seed) and the time to target of every seed (never averaged over seeds that did not reach it)."""
    arms: dict[str, list[tuple[int, dict]]] = {}
    for r in run_rows:
        a = _arm_of(r["path"])
        if a is not None and r["heldout"] is not None:
            arms.setdefault(a[0], []).append((a[1], r))
    out = []
    for arm, runs in sorted(arms.items()):
        runs.sort(key=lambda x: x[0])
        finals = [r["heldout"]["final"] for _, r in runs]
        mean = sum(finals) / len(finals)
        sd = statistics.stdev(finals) if len(finals) > 1 else None
        ttt = [r["time_to_target"] for _, r in runs]
        out.append({"arm": arm, "seeds": [sd_ for sd_, _ in runs], "heldout_final": finals, "heldout_final_mean": mean,
                    "heldout_final_sd": sd, "heldout_best": [r["heldout"]["best"] for _, r in runs],
                    "time_to_target_s": [t["time_s"] if t and t["reached"] else
                                         ("not reached within budget" if t else None) for t in ttt],
                    "reached": sum(bool(t and t["reached"]) for t in ttt)})
    return out


def _arm_markdown(arms: list[dict]) -> str:
    out = ["| arm | seeds | held-out final: mean ± sd (per seed) | best per seed | time to target per seed |",
           "|---|---|---|---|---|"]
    for a in arms:
        sd = f" ± {a['heldout_final_sd']:.3f}" if a["heldout_final_sd"] is not None else ""
        per = ", ".join(f"{x:.3f}" for x in a["heldout_final"])
        best = ", ".join(f"{x:.3f}" for x in a["heldout_best"])
        ttt = ", ".join(f"{t:.0f} s" if isinstance(t, float) else (t or "-") for t in a["time_to_target_s"])
        out.append(f"| {a['arm']} | {len(a['seeds'])} | {a['heldout_final_mean']:.3f}{sd} ({per}) | {best} | {ttt} |")
    return "\n".join(out) + "\n"


def report(paths: list[str | Path], output: str | Path, force: bool = False,
           target_accuracy: float | None = None) -> artifact.Artifact:
    """Compare eval artifacts (the first is the baseline of the paired tests) and/or train runs (curves,
    quality-vs-time-vs-memory table, time to ``target_accuracy``: on held-out accuracy where a run evaluated it,
    else on the accuracy of its training samples)."""
    output = Path(output)
    if not paths:
        raise QerlError("report needs at least one artifact.")
    if target_accuracy is not None and not 0.0 <= target_accuracy <= 1.0:  # (False for NaN too)
        raise QerlError(f"--target-accuracy must be an accuracy between 0 and 1, got {target_accuracy}.")
    arts = [artifact.open_artifact(p, (names.KIND_EVAL, names.KIND_RUN)) for p in paths]
    evals = [a for a in arts if a.kind == names.KIND_EVAL]
    runs = [a for a in arts if a.kind == names.KIND_RUN]
    rows, paired, examples = _eval_rows(evals) if evals else ([], [], [])
    arm_evals = _arm_evals(evals, examples) if evals else []
    run_rows = _run_rows(runs, target_accuracy) if runs else []

    def body(tmp: Path) -> dict:
        md = (_markdown(rows, paired, arm_evals) if rows else "") + ("\n" if rows and run_rows else "")
        arms = _arm_rows(run_rows)
        if run_rows:
            md += _run_markdown(run_rows)
            _plot(run_rows, tmp / names.REPORT_CURVES)
        if arms:
            md += "\nArms over seeds (runs named `<arm>-s<seed>`):\n\n" + _arm_markdown(arms)
        (tmp / names.REPORT_MD).write_text(md)
        (tmp / names.REPORT_JSON).write_text(json.dumps({"evals": rows, "paired": paired, "arm_evals": arm_evals,
                                                         "runs": run_rows, "arms": arms}, indent=1) + "\n")
        return {"evals": len(rows), "runs": len(run_rows)}

    inputs = [a.as_input(output) for a in arts]
    # the inputs in the order given, by where they lie: the first is the baseline, the order sets the rows', and
    # the directory names set the arms (<arm>-s<seed>) and labels (the key's own input list is a sorted digest set)
    order = [[i.path, i.digest] for i in inputs]
    art = artifact.run_stage(names.KIND_REPORT, output, {"inputs_in_order": order,
                                                         "target_accuracy": target_accuracy},
                             inputs, body, force=force)
    ui.out.print(art.file(names.REPORT_MD).read_text(), markup=False)
    return art
