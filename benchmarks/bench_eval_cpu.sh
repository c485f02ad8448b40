#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the first N GSM8K test problems, greedy, on this CPU: source weights vs NVFP4 RTN
# vs NVFP4 + AWQ, through the same engine, prompts and answer checking; ends in one `qerl report`.
#   benchmarks/bench_eval_cpu.sh WORKDIR [N]
# WORKDIR must hold quant-rtn/ and quant-awq/ (benchmarks/bench_awq.py --workdir WORKDIR makes them).
set -euo pipefail
work=${1:?WORKDIR}; n=${2:-200}
qerl="${QERL:-qerl}"
data="$(cd "$(dirname "$0")/.." && pwd)/../shared/data/gsm8k/test.jsonl"
[ -f "$data" ] || data="$(cd "$(dirname "$0")/.." && pwd)/tests/data/gsm8k/test.jsonl"
for m in rtn awq; do
  $qerl pack "$work/quant-$m" -o "$work/packed-$m" --no-progress
  $qerl verify "$work/packed-$m" -o "$work/verify-$m" --no-progress > /dev/null
  $qerl evaluate "$work/packed-$m" --verify "$work/verify-$m" --data "$data" -n "$n" -o "$work/eval-$m" --no-progress
done
$qerl evaluate smollm2-135m-instruct --data "$data" -n "$n" -o "$work/eval-source" --no-progress
$qerl report "$work/eval-source" "$work/eval-rtn" "$work/eval-awq" -o "$work/report-eval" --force
mkdir -p benchmarks/results
cp "$work/report-eval/report.json" benchmarks/results/eval_gsm8k200_cpu.json
cp "$work/report-eval/report.md" benchmarks/results/eval_gsm8k200_cpu.md
