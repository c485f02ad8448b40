"""AWQ vs round-to-nearest NVFP4 on SmolLM2-135M-Instruct (CPU): held-out perplexity and per-layer error.

    python benchmarks/bench_awq.py [--samples 128 --seq-len 512 --eval-seqs 32] [--json benchmarks/results/awq_cpu.json]

Calibrates on ../shared/data/gsm8k/train.jsonl (question + answer), evaluates perplexity on the text of
test.jsonl for bf16 weights, NVFP4 round-to-nearest and NVFP4 + AWQ, and reports calibrate wall time and peak
RSS (calibrate runs in its own subprocess so its RSS is its own). llmcompressor's AWQ is not compared: it needs
an accelerator (it pins memory) and cannot run on this CPU machine.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data" / "gsm8k"


def eval_tokens(tokenizer, n_seqs: int, seq_len: int) -> torch.Tensor:
    rows = [json.loads(line) for line in open(DATA / "test.jsonl")]
    ids: list[int] = []
    for r in rows:
        ids += tokenizer(r["question"] + "\n" + r["answer"], add_special_tokens=False)["input_ids"]
        ids.append(tokenizer.eos_token_id)
        if len(ids) >= n_seqs * seq_len:
            break
    return torch.tensor(ids[: n_seqs * seq_len]).reshape(n_seqs, seq_len)


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, batch: int = 4) -> float:
    nll, count = 0.0, 0
    for b in range(0, tokens.shape[0], batch):
        ids = tokens[b: b + batch]
        logits = model(ids).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        nll -= float(lp.sum())
        count += lp.numel()
    return math.exp(nll / count)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-seqs", type=int, default=32)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=REPO / "benchmarks" / "results" / "awq_cpu.json")
    args = ap.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="qerl-awq-"))
    qerl = [sys.executable, "-m", "qerl_cli.cli"]
    model = "smollm2-135m-instruct"

    def stage(*a: str) -> float:
        t = time.perf_counter()
        subprocess.run([*qerl, *a, "--no-progress"], check=True)
        return time.perf_counter() - t

    stage("calibrate", model, "--data", str(DATA / "train.jsonl"), "--field", "question,answer",
          "--samples", str(args.samples), "--seq-len", str(args.seq_len), "-o", str(work / "calib"))
    stage("quantize", model, "-o", str(work / "quant-rtn"))
    stage("quantize", model, "--calib", str(work / "calib"), "-o", str(work / "quant-awq"))

    from qerl_cli import artifact, modelio, packed_model
    from qerl_cli.calibrate import relative_errors
    from qerl_cli.pack import load_checkpoint

    calib = artifact.open_artifact(work / "calib", "calib")
    net, tok = modelio.load(modelio.resolve(model), torch.float32)
    tokens = eval_tokens(tok, args.eval_seqs, args.seq_len)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    results = {"bf16": perplexity(net, tokens)}
    del net
    for name in ("rtn", "awq"):
        q = artifact.open_artifact(work / f"quant-{name}", "quant")
        m = packed_model.load_dequantized_model(load_checkpoint(q), q.path, torch.float32)
        results[name] = perplexity(m, tokens)
        del m
    report = json.loads(calib.file("calib.json").read_text())
    per_type: dict[str, dict[str, list[float]]] = {}
    for r in report["groups"]:
        d = per_type.setdefault(r["group"], {"rtn": [], "awq": []})
        rel_rtn, rel_awq = relative_errors(r)
        d["rtn"].append(rel_rtn)
        d["awq"].append(rel_awq)
    gap_closed = (results["rtn"] - results["awq"]) / (results["rtn"] - results["bf16"])
    out = {
        "machine": f"{platform.node()} CPU ({torch.get_num_threads()} threads), no GPU",
        "model": model, "calib": {"samples": args.samples, "seq_len": args.seq_len, "data": "gsm8k train q+a",
                                  "wall_s": calib.metrics["wall_s"], "peak_rss_bytes": calib.metrics["peak_rss_bytes"]},
        "eval": {"data": "gsm8k test q+a", "sequences": args.eval_seqs, "seq_len": args.seq_len},
        "perplexity": results, "rtn_gap_closed_by_awq": gap_closed,
        "mean_rel_output_error": {k: {m: sum(v[m]) / len(v[m]) for m in v} for k, v in per_type.items()},
        "awq_better_on_every_layer_type": all(sum(v["awq"]) < sum(v["rtn"]) for v in per_type.values()),
        "llmcompressor": "not run: its AWQ needs an accelerator (pins memory); it fails on this CPU-only machine",
    }
    con = Console()
    t = Table(title=f"NVFP4 on {model}: held-out perplexity ({out['machine']})")
    for c in ("weights", "perplexity", "vs bf16"):
        t.add_column(c, justify="right")
    for k in ("bf16", "rtn", "awq"):
        t.add_row({"bf16": "bf16", "rtn": "NVFP4 RTN", "awq": "NVFP4 + AWQ"}[k], f"{results[k]:.3f}",
                  f"{results[k] / results['bf16'] - 1:+.2%}")
    con.print(t)
    t2 = Table(title="mean per-layer output error (MSE / output power)")
    for c in ("group", "RTN", "AWQ", "ratio"):
        t2.add_column(c, justify="right")
    for k, v in out["mean_rel_output_error"].items():
        t2.add_row(k, f"{v['rtn']:.3e}", f"{v['awq']:.3e}", f"{v['awq'] / v['rtn']:.3f}")
    con.print(t2)
    con.print(f"AWQ closes {gap_closed:.1%} of the RTN perplexity gap; calibrate took {calib.metrics['wall_s']:.0f} s, "
              f"peak RSS {calib.metrics['peak_rss_bytes'] / 2**30:.2f} GiB")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
