"""Pick the bf16 sampling temperature whose entropy matches the NVFP4 policy's at T = 1 (the review's control
for "quantization noise = exploration"). Entropy = -mean behaviour log-prob over generated tokens of a
rollout on the training prompts.

    python match_temperature.py PACKED SOURCE_MODEL --prompts arith:64 --out OUTDIR   (prints the temperature)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from qerl_cli import names
from qerl_cli.rollout import rollout


def entropy(art) -> float:
    t = load_file(str(art.file(names.ROLLOUT_TENSORS)))
    m = t["completion_mask"]
    return float(-t["tempered_logprobs"][m].mean())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("packed")
    ap.add_argument("source")
    ap.add_argument("--prompts", default="arith:64")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--temperatures", default="1.0,1.1,1.2,1.3,1.4,1.5")
    args = ap.parse_args()
    kw = dict(group=4, max_new_tokens=64, seed=0, progress=False)
    target = entropy(rollout(args.packed, args.prompts, args.out / "nvfp4-T1", temperature=1.0, **kw))
    best, table = None, {}
    for t in (float(x) for x in args.temperatures.split(",")):
        e = entropy(rollout(args.source, args.prompts, args.out / f"bf16-T{t}", temperature=t, **kw))
        table[t] = e
        if best is None or abs(e - target) < best[1]:
            best = (t, abs(e - target))
    record = {"nvfp4_entropy_T1": target, "bf16_entropy_by_temperature": table, "chosen_temperature": best[0]}
    (args.out / "match.json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record), file=sys.stderr)  # the evidence; stdout keeps only the temperature
    print(best[0])


if __name__ == "__main__":
    main()
