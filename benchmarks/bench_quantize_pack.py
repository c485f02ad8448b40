"""Quantize + pack SmolLM2-135M-Instruct on CPU through the Python API: wall time, peak RSS, artifact sizes.

Each stage runs in a fresh subprocess so its peak RSS is its own. Writes benchmarks/results/quantize_pack_cpu.json.

    .venv/bin/python benchmarks/bench_quantize_pack.py            # the embedded default model
    .venv/bin/python benchmarks/bench_quantize_pack.py --model DIR  # any HF directory or .gguf
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "quantize_pack_cpu.json"

# Run one stage in this fresh interpreter and print its own measurements as one JSON line.
CHILD = r"""
import json, resource, sys, time
stage, a, b = sys.argv[1:4]
t0 = time.perf_counter()
if stage == "quantize":
    from qerl_cli.quantize import quantize as run
else:
    from qerl_cli.pack import pack as run
t_import = time.perf_counter() - t0
art = run(a, b, progress=False, force=True)
print("RESULT " + json.dumps({
    "stage": stage,
    "wall_s_process": time.perf_counter() - t0,
    "wall_s_stage": art.metrics["wall_s"],
    "import_s": t_import,
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "metrics": art.metrics,
}))
"""


def run_stage(stage: str, a: str, b: str) -> dict:
    res = subprocess.run([sys.executable, "-c", CHILD, stage, a, b], capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{stage} failed:\n{res.stderr}")
    line = next(l for l in res.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def param_count(quant: Path) -> tuple[int, int]:
    """(all parameters of the model, weights of the quantized linears), from the quant checkpoint."""
    from safetensors import safe_open

    total = quantized = 0
    with safe_open(str(quant / "model.safetensors"), "pt") as f:
        for k in f.keys():
            shape = f.get_slice(k).get_shape()
            n = 1
            for s in shape:
                n *= s
            if k.endswith(".weight_packed"):
                quantized += 2 * n
                total += 2 * n
            elif k.endswith((".weight_scale", ".weight_global_scale")):
                continue
            else:
                total += n
    return total, quantized


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} CPU cores, {platform.system()} {platform.release()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--json", type=Path, default=RESULTS)
    args = ap.parse_args()

    load0 = list(os.getloadavg())  # other work on the machine inflates the wall times
    with tempfile.TemporaryDirectory(prefix="qerl-bench-") as tmp:
        quant, packed = Path(tmp) / "quant", Path(tmp) / "packed"
        q = run_stage("quantize", args.model, str(quant))
        p = run_stage("pack", str(quant), str(packed))
        total, quantized = param_count(quant)
        qst = __import__("safetensors.torch", fromlist=["load_file"]).load_file(str(quant / "model.safetensors"))
        ct_weight_bytes = sum(t.numel() * t.element_size() for k, t in qst.items()
                              if k.endswith((".weight_packed", ".weight_scale", ".weight_global_scale")))
        del qst
        sizes = {
            "bf16_model_bytes": 2 * total,
            "bf16_quantized_weights_bytes": 2 * quantized,
            "quant_dir_bytes": dir_bytes(quant),
            "quant_safetensors_bytes": (quant / "model.safetensors").stat().st_size,
            "quant_weight_bytes": ct_weight_bytes,
            "packed_dir_bytes": dir_bytes(packed),
            "packed_safetensors_bytes": (packed / "model.safetensors").stat().st_size,
            "packed_weight_bytes": p["metrics"]["packed_weight_bytes"],
        }
    result = {
        "model": args.model,
        "machine": machine(),
        "load_average_at_start": load0,
        "python": platform.python_version(),
        "torch": __import__("torch").__version__,
        "parameters": total,
        "quantized_weights": quantized,
        "stages": {"quantize": q, "pack": p},
        "sizes": sizes,
        "bytes_per_quantized_weight": {
            "checkpoint (codes + e4m3 scales + fp32 global)": ct_weight_bytes / quantized,
            "packed (tile records)": sizes["packed_weight_bytes"] / quantized,
            "expected": 9 / 16,
        },
        "ratio_vs_bf16": {
            "quant model.safetensors": sizes["bf16_model_bytes"] / sizes["quant_safetensors_bytes"],
            "packed model.safetensors": sizes["bf16_model_bytes"] / sizes["packed_safetensors_bytes"],
            "quantized weights only (ideal 32/9 = 3.56)": sizes["bf16_quantized_weights_bytes"] / sizes["packed_weight_bytes"],
        },
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")

    con = Console(width=140)
    mib = 2**20
    t = Table(title=f"qerl quantize + pack — {args.model} on CPU ({result['machine']})")
    t.add_column("stage")
    t.add_column("wall (stage)", justify="right")
    t.add_column("wall (process)", justify="right")
    t.add_column("peak RSS", justify="right")
    t.add_column("output", justify="right")
    t.add_column("vs bf16 model", justify="right")
    for name, st, d, f in (("quantize", q, "quant_dir_bytes", "quant_safetensors_bytes"),
                           ("pack", p, "packed_dir_bytes", "packed_safetensors_bytes")):
        t.add_row(name, f"{st['wall_s_stage']:.1f} s", f"{st['wall_s_process']:.1f} s",
                  f"{st['peak_rss_bytes'] / mib:,.0f} MiB", f"{sizes[d] / mib:,.1f} MiB",
                  f"{sizes[f] / sizes['bf16_model_bytes']:.3f}x")
    con.print(t)
    t2 = Table(title="sizes")
    t2.add_column("what")
    t2.add_column("value", justify="right")
    t2.add_row("parameters (bf16 size)", f"{total / 1e6:.1f} M ({sizes['bf16_model_bytes'] / mib:,.1f} MiB)")
    t2.add_row("quantized linear weights", f"{quantized / 1e6:.1f} M ({quantized / total:.1%} of parameters)")
    for k, v in result["bytes_per_quantized_weight"].items():
        t2.add_row(f"bytes per quantized weight: {k}", f"{v:.5f}")
    for k, v in result["ratio_vs_bf16"].items():
        t2.add_row(f"bf16 / ours: {k}", f"{v:.3f}")
    con.print(t2)
    con.print(f"load average at start: {load0[0]:.2f} (1 min); JSON: {args.json}")


if __name__ == "__main__":
    main()
