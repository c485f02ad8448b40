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


def report(paths: list[str | Path], output: str | Path, force: bool = False) -> artifact.Artifact:
    """Compare eval artifacts (the first is the baseline of the paired tests)."""
    output = Path(output)
    if not paths:
        raise QerlError("report needs at least one artifact.")
    arts = [artifact.open_artifact(p, (names.KIND_EVAL,)) for p in paths]
    rows, paired = _eval_rows(arts)

    def body(tmp: Path) -> dict:
        (tmp / names.REPORT_MD).write_text(_markdown(rows, paired))
        (tmp / names.REPORT_JSON).write_text(json.dumps({"evals": rows, "paired": paired}, indent=1) + "\n")
        return {"evals": len(rows)}

    art = artifact.run_stage(names.KIND_REPORT, output, {"baseline": str(arts[0].path)},
                             [a.as_input(output) for a in arts], body, force=force)
    ui.out.print(art.file(names.REPORT_MD).read_text())
    return art
