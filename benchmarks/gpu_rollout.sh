#!/usr/bin/env bash
# One device run: GPU tests of the engine (this builds the kernel) + the rollout benchmark. Writes under $OUT.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -m pytest -q -m gpu tests/test_engine_gpu.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
smol=""
[ -f /root/smol/smol.gguf ] && smol="--smollm2 /root/smol/smol.gguf"
python3 benchmarks/bench_rollout.py $smol --json "$OUT/rollout_h200.json" 2>&1 | tee "$OUT/bench_rollout.log"
