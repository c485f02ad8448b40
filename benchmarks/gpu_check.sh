#!/usr/bin/env bash
# One device run: build the CUDA extension, run the GPU tests, benchmark; logs and JSON under $OUT.
#   usage (repo root): OUT=/tmp/out bash benchmarks/gpu_check.sh [tests|bench|all]
set -o pipefail
OUT=${OUT:-/tmp/qerl-gpu-check}; mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/qerl-ext} MAX_JOBS=16
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem --format=csv 2>&1 | tee "$OUT/smi.txt"
t0=$(date +%s)
python3 -c "
from qerl_cli import kernel; import time; t=time.time(); ok=kernel.available()
print('kernel available:', ok, kernel.build_error(), f'build+load {time.time()-t:.1f}s')
" 2>&1 | tee "$OUT/build.log"
so=$(ls "$TORCH_EXTENSIONS_DIR"/*/qerl_nvfp4/*.so "$TORCH_EXTENSIONS_DIR"/qerl_nvfp4/*.so 2>/dev/null | head -1)
if [ -n "$so" ] && command -v cuobjdump >/dev/null; then
  cuobjdump -sass "$so" > /tmp/all.sass 2>/dev/null
  python3 - <<'PY' | tee "$OUT/sass_summary.txt"
import re, collections
text = open('/tmp/all.sass').read()
for block in re.split(r'\n\s*Function : ', text)[1:]:
    name = block.split('\n', 1)[0].strip()
    if 'sm_90' not in text: pass
    ops = collections.Counter(m.group(1).split('.')[0] for m in re.finditer(r'/\*[0-9a-f]{4,6}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)', block))
    total = sum(ops.values())
    print(name[:90], 'total', total, ' '.join(f'{k}:{v}' for k, v in ops.most_common(18)))
    if 'ILi1ELi1ELi6ELi12ELi2ELi6E' in name and 'tg1' not in globals():
        tg1 = 1; open('/tmp/tg1.sass', 'w').write(block)
PY
  cp /tmp/tg1.sass "$OUT/tg1_sm90a.sass" 2>/dev/null
fi
if [ "$what" = all ] || [ "$what" = ncu ]; then
  for shape in "37888 3584 1" "3584 18944 1"; do
    timeout 120 ncu --clock-control none --kernel-name regex:nvfp4_mma --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section Occupancy --section LaunchStats \
      --section MemoryWorkloadAnalysis python3 benchmarks/ncu_probe.py $shape 2>&1 | grep -vE "^==PROF==|^\s*$" \
      | tee -a "$OUT/ncu.txt" | grep -E "Duration|Throughput|Issue|Eligible|Active Warps|Registers|Stall|Achieved|Block Limit|Grid Size|Waves|Warp Cycles" | head -40
  done
fi
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout 420 python3 -m pytest -m gpu tests/test_kernel.py -q -x -p no:cacheprovider 2>&1 | tee "$OUT/test_gpu.log"
fi
if [ "$what" = all ] || [ "$what" = bench ]; then
  timeout 400 python3 benchmarks/bench_kernel.py --json "$OUT/kernel_h200.json" 2>&1 | tee "$OUT/bench.log"
fi
echo "gpu_check wall $(( $(date +%s) - t0 ))s"
