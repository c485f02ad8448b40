"""``qerl report``: eval artifacts side by side (accuracy ± CI, paired test on shared examples, time, tokens,
memory) and, for train runs, learning curves as PNG plus a quality-vs-time-vs-memory table.
Markdown and JSON outputs."""

from __future__ import annotations

import json
from pathlib import Path

from . import artifact, names, stats, ui
from .errors import QerlError


def _eval_rows(arts: list[artifact.Artifact]) -> tuple[list[dict], list[dict]]:
    summaries = [json.loads(a.file(names.EVAL_SUMMARY).read_text()) for a in arts]
    ids = {s["dataset_id"] for s in summaries}
    if len(ids) > 1:
        names_ = ", ".join(f"{a.path} ({s['dataset']}, {s['examples']} examples)" for a, s in zip(arts, summaries))
        raise QerlError(f"these eval artifacts evaluated different datasets, so they do not compare: {names_}.")
    examples = []
    for a in arts:
        ex = {}
        for line in a.file(names.EVAL_EXAMPLES).read_text().splitlines():
            e = json.loads(line)
            ex[e["index"]] = e
        examples.append(ex)
    rows = []
    for a, s in zip(arts, summaries):
        p = s["policy"]
        rows.append({"path": str(a.path), "weights": p.get("weights"), "adapter": (p.get("adapter_digest") or "none")[:12],
                     "temperature": p.get("temperature"), "aqn_sigma": p.get("aqn", {}).get("sigma"),
                     "examples": s["examples"], "accuracy": s["accuracy"], "ci95": s["accuracy_ci95"],
                     "generated_tokens": s["generated_tokens"], "wall_s": a.metrics.get("wall_s"),
                     "peak_rss_bytes": a.metrics.get("peak_rss_bytes"),
                     "peak_cuda_bytes": a.metrics.get("peak_cuda_allocated") or a.metrics.get("peak_cuda_bytes")})
    paired = []
    base = examples[0]
    for a, ex in zip(arts[1:], examples[1:]):
        shared = sorted(set(base) & set(ex))
        x = [float(base[i]["correct"]) for i in shared]
        y = [float(ex[i]["correct"]) for i in shared]
        b = sum(1 for i in shared if base[i]["correct"] is True and ex[i]["correct"] is False)
        c = sum(1 for i in shared if base[i]["correct"] is False and ex[i]["correct"] is True)
        entry = {"baseline": str(arts[0].path), "other": str(a.path), "shared_examples": len(shared),
                 "baseline_only_correct": b, "other_only_correct": c}
        if all(isinstance(base[i]["correct"], bool) for i in shared):
            entry["mcnemar_exact_p"] = stats.mcnemar_exact(b, c)
        entry["paired_bootstrap"] = stats.paired_bootstrap(x, y) if shared else None
        paired.append(entry)
    return rows, paired


def _markdown(rows: list[dict], paired: list[dict]) -> str:
    out = ["| eval | weights | adapter | T | AQN σ | n | accuracy | 95% CI | tokens | wall s | peak RSS GiB |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['path']} | {r['weights']} | {r['adapter']} | {r['temperature']} | {r['aqn_sigma']} | "
                   f"{r['examples']} | {r['accuracy']:.4f} | [{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}] | "
                   f"{r['generated_tokens']} | {r['wall_s'] or 0:.1f} | {(r['peak_rss_bytes'] or 0) / 2**30:.2f} |")
    if paired:
        out += ["", "| vs baseline | shared | only baseline right | only other right | McNemar p | mean diff [95% CI] |",
                "|---|---|---|---|---|---|"]
        for p in paired:
            bs = p["paired_bootstrap"]
            out.append(f"| {p['other']} | {p['shared_examples']} | {p['baseline_only_correct']} | "
                       f"{p['other_only_correct']} | {p.get('mcnemar_exact_p', float('nan')):.4g} | "
                       f"{bs['mean_diff']:+.4f} [{bs['ci95'][0]:+.3f}, {bs['ci95'][1]:+.3f}] |")
    return "\n".join(out) + "\n"


CURVES = ("accuracy", "reward_mean", "informative_fraction", "entropy")


def _run_rows(arts: list[artifact.Artifact], target: float | None) -> list[dict]:
    rows = []
    for a in arts:
        steps = [json.loads(line) for line in a.file(names.RUN_METRICS).read_text().splitlines() if line.strip()]
        if not steps:
            raise QerlError(f"{a.path} has no steps in {names.RUN_METRICS}.")
        t, elapsed = 0.0, []
        for m in steps:
            t += m.get("time_step_s", 0.0)
            elapsed.append(t)
        reached = None
        if target is not None:
            for m, e in zip(steps, elapsed):
                if m.get("accuracy", 0.0) >= target:
                    reached = {"step": m["step"], "time_s": e}
                    break
        peak_cuda = max(m.get("peak_mem_allocated_bytes", 0) or 0 for m in steps)
        peak_rss = max(m.get("peak_rss_bytes", 0) or 0 for m in steps)
        rows.append({"path": str(a.path), "steps": len(steps), "time_s": t,
                     "final": {k: steps[-1].get(k) for k in CURVES},
                     "best_accuracy": max(m.get("accuracy", 0.0) for m in steps),
                     "peak_cuda_allocated_bytes": peak_cuda, "peak_rss_bytes": peak_rss,
                     "target_accuracy": target,
                     "time_to_target": reached if reached else ("not reached within budget" if target is not None else None),
                     "curves": {k: [[e, m.get(k)] for m, e in zip(steps, elapsed)] for k in CURVES}})
    return rows


def _plot(rows: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise QerlError("plotting train curves needs matplotlib: pip install 'qerl[plot]'.") from None
    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, key in zip(axes.flat, CURVES):
        for r in rows:
            pts = [(x, y) for x, y in r["curves"][key] if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", label=r["path"])
        ax.set_title(key)
        ax.set_xlabel("training time (s)")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _run_markdown(rows: list[dict]) -> str:
    out = ["| run | steps | time s | final accuracy | best accuracy | final entropy | informative | peak CUDA GiB "
           "| peak RSS GiB | time to target |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["final"]
        ttt = r["time_to_target"]
        ttt = f"step {ttt['step']}, {ttt['time_s']:.0f} s" if isinstance(ttt, dict) else (ttt or "-")
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        out.append(f"| {r['path']} | {r['steps']} | {r['time_s']:.0f} | {fmt(f['accuracy'])} | {r['best_accuracy']:.3f} | "
                   f"{fmt(f['entropy'])} | {fmt(f['informative_fraction'])} | "
                   f"{r['peak_cuda_allocated_bytes'] / 2**30:.2f} | {r['peak_rss_bytes'] / 2**30:.2f} | {ttt} |")
    return "\n".join(out) + "\n\nCurves: `curves.png` (accuracy, reward, informative-group fraction, entropy vs training time).\n"


def report(paths: list[str | Path], output: str | Path, force: bool = False,
           target_accuracy: float | None = None) -> artifact.Artifact:
    """Compare eval artifacts (the first is the baseline of the paired tests) and/or train runs (curves,
    quality-vs-time-vs-memory table, time to ``target_accuracy`` on the training batches)."""
    output = Path(output)
    if not paths:
        raise QerlError("report needs at least one artifact.")
    arts = [artifact.open_artifact(p, (names.KIND_EVAL, names.KIND_RUN)) for p in paths]
    evals = [a for a in arts if a.kind == names.KIND_EVAL]
    runs = [a for a in arts if a.kind == names.KIND_RUN]
    rows, paired = _eval_rows(evals) if evals else ([], [])
    run_rows = _run_rows(runs, target_accuracy) if runs else []

    def body(tmp: Path) -> dict:
        md = (_markdown(rows, paired) if rows else "") + ("\n" if rows and run_rows else "")
        if run_rows:
            md += _run_markdown(run_rows)
            _plot(run_rows, tmp / names.REPORT_CURVES)
        (tmp / names.REPORT_MD).write_text(md)
        (tmp / names.REPORT_JSON).write_text(json.dumps({"evals": rows, "paired": paired, "runs": run_rows},
                                                        indent=1) + "\n")
        return {"evals": len(rows), "runs": len(run_rows)}

    art = artifact.run_stage(names.KIND_REPORT, output, {"baseline": str(arts[0].path),
                                                         "target_accuracy": target_accuracy},
                             [a.as_input(output) for a in arts], body, force=force)
    ui.out.print(art.file(names.REPORT_MD).read_text())
    return art
