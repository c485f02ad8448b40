#!/usr/bin/env bash
# One device run: kernel build + GPU tests of kernel and engine + rollout benchmark. Writes under $OUT.
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=src:/tmp/site
fi
python3 -m pytest -q -m gpu tests/test_engine_gpu.py tests/test_kernel.py 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
smol=""
[ -f /root/smol/smol.gguf ] && smol="--smollm2 /root/smol/smol.gguf"
python3 benchmarks/bench_rollout.py $smol --json "$OUT/rollout_h200.json" 2>&1 | tee "$OUT/bench_rollout.log"
