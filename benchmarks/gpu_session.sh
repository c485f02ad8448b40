#!/usr/bin/env bash
# Device runs of one session, in order (each a separate `run` call on the same warm machine; the real SmolLM2
# GGUF travels in two halves, see ../shared/tools/carry-smollm2.sh). Everything it writes for us goes to $OUT.
#   1  (carry .carry/p1)          kernel build, GPU tests (kernel, engine, train), 7B-shape rollout bench + profile
#   2  (carry .carry/p2 .carry/whl) assemble the GGUF; calibrate -> quantize -> pack -> verify (the main job's
#                                  front half); entropy-matched T; then starts the matrix runs of SEEDS
#                                  (default "0 1") in the background (setsid): call part 3 at once (a machine
#                                  left idle for 30 s is handed back, the runs with it)
#   3                              waits for those runs (all arms and seeds side by side, 6-minute budgets),
#                                  then the report of the training runs
#   5                              engine check on a fresh machine: both extensions built, the engine's GPU tests,
#                                  7B-shape rollout at batch 8 without and with a rank-32 adapter
#   6                              session 5: both extensions built, the kernel / fused / engine GPU tests, the
#                                  small-M kernel bench (7B and 32B shapes, with and without PDL)
#   7                              session 5: the 7B-shape rollout bench with profile and ablations (after 6, warm)
#   9                              session 6: build, kernel / fused / engine GPU tests, small-M kernel bench,
#                                  7B-shape rollout bench (one call)
#   10                             session 7: build, small-M floors (probe_small.py at M = 1 and 8), ncu counters
#                                  of the 7B launches at M = 8, TESTS (default: the cluster equality test), kernel
#                                  bench over MS (default 1,8,16,32,65)
#   11 [AB=dir]                    session 7: build, A/B of this tree's kernel against the one in AB (default
#                                  abtmp/, an older nvfp4_kernel.cu) in one process, then TESTS (default: the
#                                  kernel's GPU tests)
#   12                             session 7: build, the fused kernels' and engine's GPU tests (TESTS), then the
#                                  7B-shape LoRA rollout bench (batched terms in the fused LoRA kernels, in cuBLAS,
#                                  per member)
#   13                             session 8: build, the extensions' bad-argument test, the fused kernels' GPU tests
#                                  and the v2 fixup equality test, LoRA terms per fused group (probe_small --lora),
#                                  A/B of the v2 fixups (batched against serial) at M = 1-16
#   14 [AB=dir]                    session 8: build (and AB's kernel, default abtmp/, beside it), the check-crash
#                                  bisect (probe_check_crash.py), Nsight Compute on the LoRA terms, A/B of this
#                                  tree's kernel against AB's, the kernel and engine GPU tests (TESTS)
#   15                             session 8: build, the extensions' GPU tests (TESTS), LoRA terms per fused
#                                  group, the 7B-shape LoRA rollout bench
#   16                             session 9: build, the small-M variants VARIANTS side by side with cuBLAS and auto
#                                  (ab_kernel.py --variants) at MS (default 1,8,16), then TESTS (default: the
#                                  kernel's GPU tests)
#   21                             session 10 (prepared): build, the stream-K kernel's GPU tests now reaching M = 64,
#                                  VARIANTS (default default,alt,v2,v2w8) beside cuBLAS at MS (default 32,40,64), the
#                                  7B-shape NVFP4 rollout at batch 8 and 64 per kernel variant (RVARIANTS, auto,v2w8)
#   22                             session 10 (prepared, branch decode-attn): build, the decode attention kernel's GPU
#                                  tests with the fused and engine ones, bench_decode_attn.py (against SDPA alone),
#                                  the 7B-shape rollout with and without it at batch 8 and 64
#   23                             (branch next-gpu: v2-m64 and decode-attn together) parts 21 and 22 in two calls on
#                                  one machine: `bash benchmarks/gpu_session.sh 23` (build, both sets of GPU tests,
#                                  the variants at M = 32-64, attention alone), then `... 23b` at once (the rollouts);
#                                  session 11 added the fp32-scale add + RMSNorm kernel (branch norm-fp32; its test
#                                  is in test_fused_gpu.py, run by 23) and `... 23c`: the AQN rollouts (noise on,
#                                  the fp32-scale kernel against torch norms)
#   24 / 24b                       session 12 (branch next-gpu; 22-24 need its decode attention kernel, which stayed
#                                  on its branch): 23-23c in two calls on one warm machine
#   25                             session 12, main: build, the v2-vs-default and calibrate GPU tests, the AQN
#                                  rollouts, the variants at M = 32-64, the 7B rollout per variant (auto, v2w8)
#   26                             session 12, main: build, every GPU test file, then the 7B-shape rollout at batch
#                                  8 and 64 under auto (the rules of session 12)
#   27                             session 13 (branch lora-preshrink): build, the fused and engine GPU tests (the
#                                  LoRA shrinks fused into the norm / SiLU·mul kernels), the 7B-shape LoRA rollout
#                                  bench (fused shrinks against separate ones, interleaved), LoRA terms per group
#   28                             session 13 (branch fused-sampler): build, the fused and engine GPU tests (the
#                                  fused sampling kernel), the 7B-shape rollouts with the fused sampler against
#                                  torch's sampling ops (bench_rollout.py --sampler)
#   29                             session 13, main: build, every GPU test file, then the 7B-shape LoRA rollout
#                                  bench (it ran with the q/k/v expand inside the rotary kernel, measured slower and
#                                  removed; the bench now times fused against separate shrinks, interleaved)
#   30                             session 13, final main: build, the fused / engine / extension-error GPU tests
#   31                             (prepared in session 13, not run) build, the fused / engine GPU tests, the LoRA
#                                  rollout bench with the gate/up expand in our kernel as a third arm, then the
#                                  adapter decode step's profile (where the remaining ~1.1 ms of LoRA goes)
#   32                             session 14: build, the GPU tests of the LoRA term inside the NVFP4 kernels, LoRA
#                                  terms per group at M = 8 (probe_small --lora 32: the expand alone against the term
#                                  in our kernel), the 7B-shape LoRA rollout bench (term in the kernel against expand
#                                  kernels, interleaved), then the kernel, fused and engine GPU tests in the time left
#   33                             session 14: part 32 without the kernel / fused / engine GPU tests (after the L2
#                                  prefetch of the term's bs slices)
#   34                             (prepared in session 14, not run) build, every GPU test file, those edited after
#                                  session 14's last GPU run first
#   35                             session 15: build, the kernel's new row-order test (M = 16 after 13 in a fresh
#                                  process), then every GPU test file
#   35b                            session 15, right after 35 on the warm machine: the 7B-shape rollouts at the batch
#                                  sizes of RL training (RL_BATCHES, default 8,32,64), bf16 and NVFP4, each without
#                                  and with a rank-32 adapter
#   36                             session 15 (the LoRA term inside the NVFP4 kernels up to 64 rows): build, the
#                                  term's and the engine's GPU tests, the 7B-shape RL-batch rollouts (RL_BATCHES,
#                                  default 8,32,64: terms in the kernel against outside, interleaved), then the
#                                  kernel's GPU tests in the time left
#   37                             session 16 (decode attention in our kernel, fused.decode_attn): build, its GPU
#                                  tests with the engine's, the attention alone against SDPA
#                                  (bench_decode_attn.py), the 7B-shape rollouts with and without it, interleaved
#   38                             session 17 (decode attention measured at 0.47-0.79x SDPA in 37): build, where its
#                                  time goes (probe_decode_attn.py: splits swept, PDL off, a launch floor), Nsight
#                                  Compute on it and on SDPA's kernel at batch 8
#   39                             session 17, after 38 (the last block's combine of the splits made parallel):
#                                  build, the decode-attention GPU tests, probe_decode_attn.py, bench_decode_attn.py,
#                                  the 7B-shape rollouts with and without it, interleaved
#   40                             session 18 (decode attention rewritten on the tensor cores, splits added in a
#                                  thread-block cluster): what 39 runs
#   41                             session 18, prepared: build, the 7B-shape rollouts with a rank-32 adapter, decode
#                                  attention in our kernel against SDPA with PDL on and off, per-kernel profiles
#   42                             session 19 (commit 0d9c6d9 only): build, the cluster / PDL / decode-attention /
#                                  L2-prefetch GPU tests, the L2-prefetch probe, the 7B-shape rollouts with the
#                                  gate/up weight's L2 prefetch (settings: L2PF, default "0 24 40 24@start")
#   43 [MS]                        session 20 (sm_90a code only): both builds (normal and timeline probe), the GPU
#                                  tests of SiLU·mul in the gate/up kernel and of the engine, benchmarks/probe_timeline.py
#                                  (per-CTA timestamps of the small-M kernels in chains of one shape at MS, default
#                                  1,8,16, M = 8 again without PDL, and in a 7B-shape decode step at batch 8) after
#                                  the 7B-shape rollouts with SiLU·mul in the gate/up kernel against without; T43
#                                  (default 560): the seconds after which the probe is cut off
#   45 [MS]                        session 20, prepared: the timeline probe build and benchmarks/probe_timeline.py
#                                  alone (the check before commit 61b3ce5's deferred sums, part 44 there)
#   46 [MS GRIDS T46]              session 21 (sm_90a code only): the timeline probe build (128-byte records: first
#                                  segment's loop end, ticket and sum times, units), benchmarks/probe_timeline.py with
#                                  every record kept (timeline_raw.npz), the gate/up and down chains again at each
#                                  stream-K CTA count in GRIDS (default 132,198); the normal build beside the probe,
#                                  then the engine's GPU tests (SiLU·mul in the gate/up kernel on) until T46 (560)
#   47 [MS]                        session 21 (sm_90a code only): build, benchmarks/probe_partition.py (stream-K grid
#                                  sizes aligned with row groups, 8 and 4 warps per CTA, against auto and cuBLAS)
#   48 [MS]                        session 21 (sm_90a code only): build, the kernel / engine / LoRA-term GPU tests
#                                  (row-group-aligned stream-K grids, v2w8 for 7B q/k/v and o at M <= 8), the 7B-shape
#                                  rollouts aligned against default grids (bench_rollout.py --v2-aligned), then the
#                                  kernel bench (7B and 32B shapes at MS, default 1,8,16) until 580 s
#   49                             session 21 (sm_90a code only): build, the small-M kernel GPU tests with the 10-warp
#                                  stream-K variant (v2w10), probe_partition.py on gate/up (v2w8, v2w10) and down
#   50                             session 21 (sm_90a code only): build, every GPU test file, the 7B-shape rollouts
#                                  with session 21's grids (aligned, v2w10 gate/up) against the default grids
#                                  (bench_rollout.py --v2-aligned), the kernel bench (7B and 32B, M = 1, 8, 16)
#   51                             session 21 (sm_90a code only): both builds (normal and timeline probe) side by
#                                  side, the LoRA-term GPU tests (v2w10 among the variants) and the kernel's auto /
#                                  aligned / pair-mode ones, then the timeline probe at M = 8 (chains, 7B decode step)
#   52                             session 21 (sm_90a code only): build, the GPU tests of the aligned grids' split-K
#                                  sums through thread-block clusters (set_v2_cluster), probe_partition --cluster-ab
#                                  (q/k/v, o, down at M = 1, 8, 16), the 7B-shape rollouts clusters against workspace
#   53                             (prepared in session 21, for an H200) build, the engine / kernel / LoRA-term GPU
#                                  tests with the cluster sums on by default, then the 7B-shape rollouts with the
#                                  aligned grids against session 20's (bench_rollout.py --v2-aligned) until 580 s
#   54                             (prepared in session 21, right after 53 on the warm machine) the kernel bench of
#                                  issue 4: 7B and 32B shapes at every M of MS (default 1,2,4,8,16,32,64,128,256,
#                                  1024,4096)
#   55                             session 22 (sm_90a code only): build, the decode-attention, fused, engine and kernel
#                                  GPU tests (the rotary inside the attention kernel; auto's v2w8 rule at M <= 16),
#                                  the 7B-shape rollouts with the rotary inside against rope_kv + decode_attn
#                                  (bench_rollout.py --rope-in-attn), the kernel bench (7B and 32B, M = 1, 8, 16)
#   58                             session 22 (sm_90a code only): build, the pair-mode, engine and LoRA-term GPU tests
#                                  (-k "silu or lora or shrink"), the 7B-shape rank-32 rollouts with the gate/up term
#                                  inside the SiLU·mul pair kernel against the two kernels (bench_rollout --silu-lora)
#   59                             session 22 (sm_90a code only): build, the pair-mode GPU tests (-k linear_silu), the
#                                  7B-shape SiLU·mul-in-kernel rollouts without an adapter (bench_rollout --silu-in-kernel)
#   60                             session 22 (sm_90a code only): build, the pair-mode GPU tests (-k linear_silu)
#   (61)                           session 22, an ad-hoc call on the warm machine after 60: the engine, LoRA-term,
#                                  train and fused GPU test files (results/s22/part61_gpu_tests_h100.log)
#   (62)                           session 22, an ad-hoc call after the engine's _term_in_kernel refactor: both
#                                  extensions built, the engine and LoRA-term GPU test files (part62_gpu_tests_h100.log)
#   (71)                           session 28, ad-hoc calls on the warm H100 after 70 and the rotary-table fix: the
#                                  kept-graph test and bench_rollout.py --keep-graph (results/s28/adhoc_*), then the
#                                  train, LoRA-term, engine, decode-attention and fused GPU test files
#   72                             session 29 (session 30 on an H100): the default build, the kept-graph GPU test,
#                                  bench_rollout.py --keep-graph (7B, batch 8) on an H200 (issue 5's 3,000 tok/s)
#   73                             session 29 (session 30 on an H100): a build with the rolling L2 prefetch
#                                  (-DQERL_V2_PREFETCH_LOOP), its GPU test, the distances PFS beside cuBLAS, the 7B
#                                  rollouts kept with and without it (PFARM)
#   74                             session 30: the default build, every GPU test file (-rfs: skip reasons logged)
#   75                             session 31: the default build, bench_rollout.py's full default run (SmolLM2 shapes
#                                  with HF generate, 7B shapes with HF generate and the ablations); ran on an H100
#   76                             session 31 (run in session 32 on an H100): the default build, the SmolLM2 rows with
#                                  their batch-256 decode steps profiled (bench_rollout.py --profile --skip-7b, then
#                                  with session 32's attention and tc256 arms, since replaced)
#   78                             session 33 (ran on an H100, buckets then on by default; opt-in since): the default
#                                  build, the engine's, decode attention's and train's GPU test files and the
#                                  dequantize_many test (attention over slot buckets), then bench_rollout.py --profile
#                                  --skip-7b (SmolLM2 rows; at batch 256 slot buckets against the whole cache, NVFP4
#                                  per-layer dequantize against per projection; decode-only profiles, no PDL)
#   77                             session 33: the default build, the per-layer dequantize's GPU tests, then
#                                  bench_rollout.py --profile --skip-7b (SmolLM2 rows; at batch 256 NVFP4 per-layer
#                                  dequantize against one launch per projection; profiles without PDL)
#   70                             (keep-graph, merged in session 28) part 69's build and engine GPU tests only (little
#                                  device time); session 28 on an H100 (results/s28/part70_*)
#   69                             (keep-graph, merged in session 28; prepared in session 25, not yet run as a whole)
#                                  build, the engine's GPU tests (the kept decode graph), the 7B-shape
#                                  rollouts with the kept graph against a capture per call (bench_rollout.py
#                                  --keep-graph), then the decode-attention, fused, LoRA-term and train GPU tests
#                                  for at most T69 (default 200) seconds
#   67                             session 24: build, the small-M kernel table (M = 1-32) and the 7B-shape rollout
#                                  table (batch 8 and 64), for at most T67 (default 450) seconds
#   66                             session 24: build, the tiled kernels' GPU tests (mma.sync tiles 1-3, wgmma tiles
#                                  4-7; TESTS) and the kernel bench at M = 64-4096 with the wgmma tiles forced (TCFGS)
#   65                             session 23: Nsight Compute on the tiled kernels' tiles (NCU_VARIANTS, default
#                                  tc1,tc3,tc2; NCU_M, default 1024)
#   64                             session 23: build, the tiled tensor-core kernel's and mid/large-M GPU tests, the
#                                  kernel bench at M = 64-4096 with the tiled kernel's three tiles forced (MODELS, MS)
#   63                             (prepared in session 22) build, the decode-attention, engine, LoRA-term and kernel
#                                  GPU test files: the review fixes made after session 22's last device call
#   57                             session 22, final main: build, the LoRA-term, train, calibrate and extension-error
#                                  GPU tests, the 7B-shape rollout at batch 8 without and with a rank-32 adapter
#                                  (bench_rollout.py --lora-only --profile: bf16 and NVFP4, and the adapter's profile)
#   56                             session 22, commit 4a0f39d only (the slab kernel was dropped after this run: slower
#                                  than v2w8 everywhere): build, the slab kernel's GPU tests with the small-M,
#                                  auto, bias, graph and LoRA-term ones, the kernel bench (7B and 32B, M = 1, 8, 16:
#                                  a slab column), the 7B-shape rollouts with and without it (bench_rollout --slab)
#   8                              session 5: build, then only the 7B-shape rollout at batch 8 without and with a
#                                  rank-32 adapter (the short end of a session's device budget)
#   4  [SEEDS]                     held-out evals of every trained arm and the matrix report (paired tests, arms
#                                  over seeds); needs the runs of parts 2-3 on the same warm machine; then the
#                                  real-SmolLM2 rollout bench
set -uo pipefail
export PYTHONPATH=$PWD/src:/tmp/site PYTHONUNBUFFERED=1 TQDM_DISABLE=1 MAX_JOBS=16
export TORCH_EXTENSIONS_DIR=/root/qerl-ext HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
OUT=${OUT:-/tmp/out}; W=/root/work; mkdir -p "$OUT" "$W"
QERL="python3 -m qerl_cli.cli"
GGUF=/root/smol/smol.gguf
t0=$(date +%s)
stamp() { echo "[gpu_session $1] +$(( $(date +%s) - t0 ))s: $2"; }

# the GPU's name and clocks into $OUT/gpu.txt, and the builds that follow for sm_90a code only (the device's
# H100 / H200; session 20's parts on)
sm90_start() {
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  export QERL_KERNEL_ARCH_FLAGS="-gencode=arch=compute_90a,code=sm_90a"
}

build() {
  python3 -c "
from qerl_cli import kernel, fused; import threading, time; t=time.time()
side = threading.Thread(target=fused.available); side.start()  # the two extensions build side by side
ok=kernel.available(); side.join()
print('kernel available:', ok, kernel.build_error(), f'build+load {time.time()-t:.1f}s')
print('fused elementwise kernels available:', fused.available(), fused.build_error())" 2>&1 | tee "$OUT/build.log"
}

# the 7B-shape rollout bench at batch 8 without and with a rank-32 adapter (bench_rollout.py --lora-only), for at
# most $1 seconds; $2: the part, for the stamp
# bench_rollout.py --profile --skip-7b (the SmolLM2 rows, their batch-256 arms and profiles) into
# $OUT/rollout_smollm2_$3.json and $OUT/bench_rollout_smollm2_$3.log, for what is left of $2 seconds since the part
# began; $1: the part, for the stamp
smollm2_profile() {
  COLUMNS=200 timeout $(( $2 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --profile --skip-7b \
    --json "$OUT/rollout_smollm2_$3.json" 2>&1 | tee "$OUT/bench_rollout_smollm2_$3.log" | grep -v '^{' | grep -v '━\|──'
  stamp "$1" "rollouts and profiles done"
}

lora_rollout() {
  timeout "$1" python3 benchmarks/bench_rollout.py --lora-only --skip-smollm2 --json "$OUT/rollout_7b_lora.json" 2>&1 \
    | tee "$OUT/bench_rollout_7b_lora.log" | grep -v '^{'
  stamp "$2" "7B LoRA rollout bench done"
}

# session 14: the GPU tests of the LoRA term inside the NVFP4 kernels, its cost per group at M = 8 against the
# expand kernels (probe_small --lora 32), the 7B-shape LoRA rollout (term in the kernel against expand kernels,
# interleaved); $1: the part, for the stamps
lora_term_checks() {
  COLUMNS=200 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_lora_in_kernel_gpu.py \
    > "$OUT/gpu_tests_lora.log" 2>&1; tail -n 25 "$OUT/gpu_tests_lora.log"
  stamp "$1" "GPU tests of the term in the kernel done"
  timeout 60 python3 benchmarks/probe_small.py --m 8 --lora 32 --json "$OUT/lora_terms_m8.json" 2>&1 | grep -v Warning \
    | tee "$OUT/lora_terms_m8.log"
  stamp "$1" "LoRA terms per group done"
  lora_rollout 120 "$1"
}

PART="${1:?part 1 to 54 (see above; 44 is in commit 61b3ce5)}"
case "$PART" in
6)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 6 "kernels built"
  timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider -rf -x ${TESTS:-tests/test_kernel.py tests/test_fused_gpu.py \
    tests/test_engine_gpu.py} 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
  stamp 6 "GPU tests done"
  timeout 200 python3 benchmarks/bench_kernel.py --models ${MODELS:-qwen2.5-7b,qwen2.5-32b} --ms ${MS:-1,8,16,64} \
    --json "$OUT/kernel_h200.json" 2>&1 | tee "$OUT/bench_kernel.log" | grep -v '^|'
  stamp 6 "kernel bench done"
  ;;
9)
  # session 6: both extensions built, the kernel / fused / engine GPU tests, the small-M kernel bench (cluster
  # split-K columns), then the 7B-shape rollout bench (no profile, ablations): one call on a fresh machine
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 9 "kernels built"
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf -x ${TESTS:-tests/test_kernel.py tests/test_fused_gpu.py \
    tests/test_engine_gpu.py} 2>&1 | tail -25 | tee "$OUT/gpu_tests.log"
  stamp 9 "GPU tests done"
  timeout 100 python3 benchmarks/bench_kernel.py --models ${MODELS:-qwen2.5-7b,qwen2.5-32b} --ms ${MS:-1,8,16} \
    --json "$OUT/kernel_h200.json" 2>&1 | tee "$OUT/bench_kernel.log" | grep -v '^|'
  stamp 9 "kernel bench done"
  timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --json "$OUT/rollout_7b_h200.json" \
    2>&1 | tee "$OUT/bench_rollout_7b.log" | grep -v '^{' | grep -v '^ '
  stamp 9 "7B rollout bench done"
  ;;
10)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 10 "kernels built"
  for m in 8 1; do
    timeout 60 python3 benchmarks/probe_small.py --m $m --json "$OUT/probe_m$m.json" 2>&1 | tee "$OUT/probe_m$m.log"
  done
  stamp 10 "probes done"
  timeout 150 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section LaunchStats --section Occupancy --section SchedulerStats \
    python3 benchmarks/probe_small.py --m 8 --ncu > "$OUT/ncu_m8.txt" 2>&1; echo "ncu rc $?"
  stamp 10 "ncu done"
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    ${TESTS:-tests/test_kernel.py -k cluster_split_equals_workspace} 2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
  stamp 10 "GPU tests done"
  timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_kernel.py --models ${MODELS:-qwen2.5-7b,qwen2.5-32b} \
    --ms ${MS:-1,8,16,32,64} --json "$OUT/kernel_h200.json" 2>&1 | tee "$OUT/bench_kernel.log" | grep -v '^|'
  stamp 10 "kernel bench done"
  ;;
11)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 11 "kernels built"
  timeout 300 python3 benchmarks/ab_kernel.py --other ${AB:-abtmp} --ms ${MS:-1,8,16,32} --json "$OUT/ab_kernel.json" \
    2>&1 | grep -v Warning | tee "$OUT/ab_kernel.log"
  stamp 11 "A/B done"
  timeout $(( 590 - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    ${TESTS:-tests/test_kernel.py} 2>&1 | tail -12 | tee "$OUT/gpu_tests.log"
  stamp 11 "GPU tests done"
  ;;
12)
  build; stamp 12 "kernels built"
  timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf ${TESTS:-tests/test_fused_gpu.py tests/test_engine_gpu.py} \
    2>&1 | tail -8 | tee "$OUT/gpu_tests.log"
  stamp 12 "GPU tests done"
  lora_rollout $(( 590 - $(date +%s) + t0 )) 12
  ;;
13)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 13 "kernels built"
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_extension_errors_gpu.py \
    tests/test_fused_gpu.py "tests/test_kernel.py::test_gpu_v2_fixups_bit_identical" 2>&1 | tail -12 \
    | tee "$OUT/gpu_tests.log"
  stamp 13 "GPU tests done"
  timeout 90 python3 benchmarks/probe_small.py --m 8 --lora 32 --json "$OUT/lora_terms_m8.json" 2>&1 \
    | grep -v Warning | tee "$OUT/lora_terms_m8.log"
  stamp 13 "LoRA terms probed"
  timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/ab_kernel.py --fixups --ms ${MS:-1,2,4,8,16} \
    --json "$OUT/ab_fixup.json" 2>&1 | grep -v Warning | tee "$OUT/ab_fixup.log"
  stamp 13 "fixup A/B done"
  ;;
14)
  python3 -c "from torch.utils.cpp_extension import load; load(name='qerl_nvfp4_ab', sources=['${AB:-abtmp}/nvfp4_kernel.cu'],
extra_cflags=['-O3'], extra_cuda_cflags=['-O3', '-gencode=arch=compute_90a,code=sm_90a'])" > "$OUT/ab_build.log" 2>&1 &
  build; wait; stamp 14 "kernels built (both A/B sides)"
  timeout 120 python3 benchmarks/probe_check_crash.py 2>&1 | tee "$OUT/bisect.log"
  timeout 120 ncu --clock-control none --kernel-name regex:"lora|gemv|gemm|splitK|cutlass|xmma" --launch-count 12 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    python3 benchmarks/probe_small.py --m 8 --lora 32 > "$OUT/ncu_lora.txt" 2>&1; echo "ncu rc $?"
  grep -E "lora|gemv|gemm|splitK|cutlass|Duration|Elapsed Cycles|Registers|Block Size|Grid Size" "$OUT/ncu_lora.txt" | head -120
  stamp 14 "bisect and ncu done"
  timeout 240 python3 benchmarks/ab_kernel.py --other ${AB:-abtmp} --ms ${MS:-1,8,16,32} --json "$OUT/ab_kernel.json" \
    2>&1 | grep -v Warning | tee "$OUT/ab_kernel.log"
  stamp 14 "A/B done"
  timeout $(( 590 - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    ${TESTS:-tests/test_kernel.py tests/test_engine_gpu.py} 2>&1 | tail -12 | tee "$OUT/gpu_tests2.log"
  stamp 14 "GPU tests done"
  ;;
15)
  build; stamp 15 "kernels built"
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf ${TESTS:-tests/test_extension_errors_gpu.py \
    tests/test_fused_gpu.py tests/test_engine_gpu.py} 2>&1 | tail -12 | tee "$OUT/gpu_tests3.log"
  stamp 15 "GPU tests done"
  timeout 90 python3 benchmarks/probe_small.py --m 8 --lora 32 --json "$OUT/lora_terms_m8.json" 2>&1 \
    | grep -v Warning | tee "$OUT/lora_terms_m8.log"
  stamp 15 "LoRA terms probed"
  lora_rollout $(( 590 - $(date +%s) + t0 )) 15
  ;;
16)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 16 "kernels built"
  timeout 300 python3 benchmarks/ab_kernel.py --variants ${VARIANTS:-v2w8,v2,default,alt} --ms ${MS:-1,8,16} \
    --json "$OUT/ab_variants.json" 2>&1 | grep -v Warning | tee "$OUT/ab_variants.log"
  stamp 16 "variants compared"
  timeout $(( 590 - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    ${TESTS:-tests/test_kernel.py} 2>&1 | tail -12 | tee "$OUT/gpu_tests_kernel.log"
  stamp 16 "GPU tests done"
  ;;
21)
  # session 10's prepared stream-K kernel at 16 < M <= 64 (forced v2 / v2w8; auto unchanged): build, its GPU tests
  # (TESTS), VARIANTS beside cuBLAS and auto at MS, then the per-variant 7B rollout (RVARIANTS) in what is left
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 21 "kernels built"
  timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf ${TESTS:-tests/test_kernel.py -k v2} 2>&1 \
    | tail -12 | tee "$OUT/gpu_tests_v2.log"
  stamp 21 "GPU tests done"
  timeout 200 python3 benchmarks/ab_kernel.py --variants ${VARIANTS:-default,alt,v2,v2w8} --ms ${MS:-32,40,64} \
    --json "$OUT/ab_variants.json" 2>&1 | grep -v Warning | tee "$OUT/ab_variants.log"
  stamp 21 "variants done"
  timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 \
    --kernel-variants ${RVARIANTS:-auto,v2w8} --json "$OUT/rollout_variants.json" 2>&1 \
    | tee "$OUT/bench_rollout_variants.log" | grep -v '^{'
  stamp 21 "rollout per variant done"
  ;;
22)
  # session 10's prepared decode attention kernel (branch decode-attn): build, its GPU tests and the fused / engine
  # ones, the kernel against SDPA alone, then the 7B-shape rollout with and without it (batch 8 and 64)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 22 "kernels built"
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf ${TESTS:-tests/test_decode_attn_gpu.py \
    tests/test_fused_gpu.py tests/test_engine_gpu.py} 2>&1 | tail -12 | tee "$OUT/gpu_tests_decode_attn.log"
  stamp 22 "GPU tests done"
  timeout 90 python3 benchmarks/bench_decode_attn.py --json "$OUT/decode_attn.json" 2>&1 | grep -v Warning \
    | tee "$OUT/decode_attn.log"
  stamp 22 "attention alone done"
  timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --decode-attn \
    --json "$OUT/rollout_decode_attn.json" 2>&1 | tee "$OUT/bench_rollout_decode_attn.log" | grep -v '^{'
  stamp 22 "rollout with and without done"
  ;;
23)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 23 "kernels built"
  timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_kernel.py -k v2 2>&1 | tail -8 \
    | tee "$OUT/gpu_tests_v2.log"
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_decode_attn_gpu.py \
    tests/test_fused_gpu.py tests/test_engine_gpu.py 2>&1 | tail -8 | tee "$OUT/gpu_tests_decode_attn.log"
  stamp 23 "GPU tests done"
  timeout 90 python3 benchmarks/bench_decode_attn.py --json "$OUT/decode_attn.json" 2>&1 | grep -v Warning \
    | tee "$OUT/decode_attn.log"
  stamp 23 "attention alone done"
  timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/ab_kernel.py --variants default,alt,v2,v2w8 \
    --ms 32,40,64 --json "$OUT/ab_variants.json" 2>&1 | grep -v Warning | tee "$OUT/ab_variants.log"
  stamp 23 "variants done"
  ;;
23b)
  build; stamp 23b "kernels loaded"
  timeout 300 python3 benchmarks/bench_rollout.py --skip-smollm2 --decode-attn --json "$OUT/rollout_decode_attn.json" \
    2>&1 | tee "$OUT/bench_rollout_decode_attn.log" | grep -v '^{'
  stamp 23b "decode attention rollouts done"
  timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --kernel-variants auto,v2w8 \
    --json "$OUT/rollout_variants.json" 2>&1 | tee "$OUT/bench_rollout_variants.log" | grep -v '^{'
  stamp 23b "kernel-variant rollouts done"
  ;;
23c)
  build; stamp 23c "kernels loaded"
  timeout $(( 590 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --aqn \
    --json "$OUT/rollout_aqn.json" 2>&1 | tee "$OUT/bench_rollout_aqn.log" | grep -v '^{'
  stamp 23c "AQN rollouts done"
  ;;
24)
  # session 12: parts 23-23c in two calls on one machine. This call: build, the GPU tests (v2 stream-K, decode
  # attention, fused incl. the fp32-scale norm, engine, calibrate, train, extension errors), verify's tests on
  # CUDA (the kernel path of the fused / transposed checks), the attention kernel alone, the decode-attn rollouts
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 24 "kernels built"
  timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_kernel.py -k "v2 or linear_t" 2>&1 \
    | tail -6 | tee "$OUT/gpu_tests_kernel.log"
  timeout 180 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_decode_attn_gpu.py tests/test_fused_gpu.py tests/test_engine_gpu.py tests/test_calibrate_gpu.py \
    tests/test_train_gpu.py tests/test_extension_errors_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  timeout 90 python3 -m pytest -q -p no:cacheprovider -rf tests/test_verify.py 2>&1 | tail -6 | tee -a "$OUT/gpu_tests.log"
  stamp 24 "GPU tests done"
  timeout 60 python3 benchmarks/bench_decode_attn.py --json "$OUT/decode_attn.json" 2>&1 | grep -v Warning \
    | tee "$OUT/decode_attn.log"
  stamp 24 "attention alone done"
  timeout $(( 575 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --decode-attn \
    --json "$OUT/rollout_decode_attn.json" 2>&1 | tee "$OUT/bench_rollout_decode_attn.log" | grep -v '^{'
  stamp 24 "decode attention rollouts done"
  ;;
24b)
  # call it at once after 24 (warm machine, extensions cached): AQN rollouts (fp32-scale kernel vs torch norms),
  # the kernel-variant rollouts, then the variants alone at M = 32-64
  build; stamp 24b "kernels loaded"
  timeout 200 python3 benchmarks/bench_rollout.py --skip-smollm2 --aqn --json "$OUT/rollout_aqn.json" 2>&1 \
    | tee "$OUT/bench_rollout_aqn.log" | grep -v '^{'
  stamp 24b "AQN rollouts done"
  timeout 200 python3 benchmarks/bench_rollout.py --skip-smollm2 --kernel-variants auto,v2w8 \
    --json "$OUT/rollout_variants.json" 2>&1 | tee "$OUT/bench_rollout_variants.log" | grep -v '^{'
  stamp 24b "kernel-variant rollouts done"
  timeout $(( 575 - $(date +%s) + t0 )) python3 benchmarks/ab_kernel.py --variants default,alt,v2,v2w8 \
    --ms 32,40,64 --json "$OUT/ab_variants.json" 2>&1 | grep -v Warning | tee "$OUT/ab_variants.log"
  stamp 24b "variants done"
  ;;
25)
  # session 12, second machine: build, the fixed v2-vs-default test and calibrate on CUDA with whole tracebacks,
  # the AQN rollouts (fp32-scale norm kernel vs torch norms), the variants at M = 32-64, the variant rollouts
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 25 "kernels built"
  COLUMNS=200 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
    tests/test_kernel.py -k "v2_matches_default" > "$OUT/gpu_tests.log" 2>&1
  COLUMNS=200 timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_calibrate_gpu.py \
    >> "$OUT/gpu_tests.log" 2>&1; tail -n 40 "$OUT/gpu_tests.log"
  stamp 25 "GPU tests done"
  timeout 170 python3 benchmarks/bench_rollout.py --skip-smollm2 --aqn --json "$OUT/rollout_aqn.json" 2>&1 \
    | tee "$OUT/bench_rollout_aqn.log" | grep -v '^{'
  stamp 25 "AQN rollouts done"
  timeout 120 python3 benchmarks/ab_kernel.py --variants default,alt,v2,v2w8 --ms 32,40,64 \
    --json "$OUT/ab_variants.json" 2>&1 | grep -v Warning | tee "$OUT/ab_variants.log"
  stamp 25 "variants done"
  timeout $(( 580 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --kernel-variants auto,v2w8 \
    --json "$OUT/rollout_variants.json" 2>&1 | tee "$OUT/bench_rollout_variants.log" | grep -v '^{'
  stamp 25 "kernel-variant rollouts done"
  ;;
26)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 26 "kernels built"
  COLUMNS=200 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    tests/test_fused_gpu.py tests/test_engine_gpu.py tests/test_calibrate_gpu.py tests/test_train_gpu.py \
    tests/test_extension_errors_gpu.py > "$OUT/gpu_tests.log" 2>&1; tail -n 30 "$OUT/gpu_tests.log"
  stamp 26 "GPU tests done"
  timeout $(( 580 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --kernel-variants auto \
    --json "$OUT/rollout_auto.json" 2>&1 | tee "$OUT/bench_rollout_auto.log" | grep -v '^{'
  stamp 26 "7B rollouts done"
  ;;
27)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 27 "kernels built"
  COLUMNS=200 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_fused_gpu.py \
    tests/test_engine_gpu.py tests/test_extension_errors_gpu.py > "$OUT/gpu_tests.log" 2>&1; tail -n 30 "$OUT/gpu_tests.log"
  stamp 27 "GPU tests done"
  lora_rollout $(( 570 - $(date +%s) + t0 )) 27
  ;;
28)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 28 "kernels built"
  COLUMNS=200 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_fused_gpu.py \
    tests/test_engine_gpu.py tests/test_extension_errors_gpu.py > "$OUT/gpu_tests.log" 2>&1; tail -n 40 "$OUT/gpu_tests.log"
  stamp 28 "GPU tests done"
  timeout $(( 570 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --sampler \
    --json "$OUT/rollout_sampler.json" 2>&1 | tee "$OUT/bench_rollout_sampler.log" | grep -v '^{'
  stamp 28 "sampler rollouts done"
  ;;
29)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 29 "kernels built"
  COLUMNS=200 timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    tests/test_fused_gpu.py tests/test_engine_gpu.py tests/test_calibrate_gpu.py tests/test_train_gpu.py \
    tests/test_extension_errors_gpu.py > "$OUT/gpu_tests.log" 2>&1; tail -n 30 "$OUT/gpu_tests.log"
  stamp 29 "GPU tests done"
  lora_rollout $(( 575 - $(date +%s) + t0 )) 29
  ;;
30)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 30 "kernels built"
  COLUMNS=200 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_fused_gpu.py \
    tests/test_engine_gpu.py tests/test_extension_errors_gpu.py > "$OUT/gpu_tests.log" 2>&1; tail -n 30 "$OUT/gpu_tests.log"
  stamp 30 "GPU tests done"
  ;;
31)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 31 "kernels built"
  COLUMNS=200 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_fused_gpu.py \
    tests/test_engine_gpu.py > "$OUT/gpu_tests.log" 2>&1; tail -n 20 "$OUT/gpu_tests.log"
  stamp 31 "GPU tests done"
  timeout $(( 575 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --lora-only --profile --skip-smollm2 \
    --json "$OUT/rollout_7b_lora.json" 2>&1 | tee "$OUT/bench_rollout_7b_lora.log" | grep -v '^{'
  stamp 31 "LoRA rollouts and profile done"
  ;;
32)
  # session 14: the LoRA terms inside the NVFP4 kernels (kernel.linear_lora), then the kernel / fused / engine GPU
  # tests in the time left
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 32 "kernels built"
  lora_term_checks 32
  COLUMNS=200 timeout $(( 585 - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
    tests/test_kernel.py tests/test_fused_gpu.py tests/test_engine_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -n 15 "$OUT/gpu_tests.log"
  stamp 32 "kernel, fused and engine GPU tests done"
  ;;
33)
  # session 14, second version (the term's B slices prefetched into L2 in the PDL prologue): part 32 without the
  # kernel / fused / engine GPU tests (the device time left)
  build; stamp 33 "kernels built"
  lora_term_checks 33
  ;;
34)
  # (prepared in session 14, not run) the GPU tests edited after session 14's last GPU run (the LoRA term's, the
  # engine's), then every other GPU test file, on one fresh machine
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 34 "kernels built"
  COLUMNS=200 timeout $(( 585 - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
    tests/test_lora_in_kernel_gpu.py tests/test_engine_gpu.py tests/test_kernel.py tests/test_fused_gpu.py \
    tests/test_extension_errors_gpu.py tests/test_calibrate_gpu.py tests/test_train_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -n 30 "$OUT/gpu_tests.log"
  stamp 34 "GPU tests done"
  ;;
35)
  # session 15: part 34 after the fix of the kernel launchers' shared-memory limit (a larger M after a smaller one
  # on one instance failed with "invalid argument"), its regression test first
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 35 "kernels built"
  COLUMNS=200 timeout $(( 585 - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
    tests/test_kernel.py::test_gpu_row_counts_shrinking_and_growing tests/test_lora_in_kernel_gpu.py \
    tests/test_engine_gpu.py tests/test_kernel.py tests/test_fused_gpu.py tests/test_extension_errors_gpu.py \
    tests/test_calibrate_gpu.py tests/test_train_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -n 30 "$OUT/gpu_tests.log"
  stamp 35 "GPU tests done"
  ;;
35b)
  build; stamp 35b "kernels loaded"
  timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 \
    --rl-batches "${RL_BATCHES:-8,32,64}" --json "$OUT/rollout_7b_rl_batches.json" 2>&1 \
    | tee "$OUT/bench_rollout_7b_rl_batches.log" | grep -v '^{'
  stamp 35b "RL-batch rollouts done"
  ;;
36)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 36 "kernels built"
  COLUMNS=200 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
    tests/test_lora_in_kernel_gpu.py tests/test_engine_gpu.py > "$OUT/gpu_tests_lora_engine.log" 2>&1
  tail -n 12 "$OUT/gpu_tests_lora_engine.log"
  stamp 36 "term and engine GPU tests done"
  timeout 200 python3 benchmarks/bench_rollout.py --skip-smollm2 --rl-batches "${RL_BATCHES:-8,32,64}" \
    --json "$OUT/rollout_7b_rl_batches.json" 2>&1 | tee "$OUT/bench_rollout_7b_rl_batches.log" | grep -v '^{'
  stamp 36 "RL-batch rollouts done"
  COLUMNS=200 timeout $(( 520 - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=line \
    tests/test_kernel.py > "$OUT/gpu_tests_kernel.log" 2>&1
  tail -n 8 "$OUT/gpu_tests_kernel.log"
  stamp 36 "kernel GPU tests done"
  ;;
37)
  # session 16: one decode step's attention in our kernel (fused.decode_attn) against SDPA: its GPU tests, the
  # fused-kernel and engine GPU tests, the attention alone, then the 7B-shape rollouts with and without it
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 37 "kernels built"
  COLUMNS=200 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_decode_attn_gpu.py \
    tests/test_engine_gpu.py > "$OUT/gpu_tests_attn.log" 2>&1; tail -n 25 "$OUT/gpu_tests_attn.log"
  stamp 37 "decode-attention and engine GPU tests done"
  timeout 60 python3 benchmarks/bench_decode_attn.py --json "$OUT/decode_attn.json" 2>&1 | tee "$OUT/decode_attn.log"
  stamp 37 "decode attention timed"
  timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --decode-attn \
    --json "$OUT/rollout_7b_decode_attn.json" 2>&1 | tee "$OUT/bench_rollout_7b_decode_attn.log" | grep -v '^{'
  stamp 37 "decode-attention rollouts done"
  ;;
38)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 38 "kernels built"
  timeout 150 python3 benchmarks/probe_decode_attn.py --json "$OUT/probe_decode_attn.json" 2>&1 \
    | tee "$OUT/probe_decode_attn.log"
  stamp 38 "decode attention probed"
  timeout 200 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    python3 benchmarks/probe_decode_attn.py --ncu > "$OUT/ncu_decode_attn.txt" 2>&1; echo "ncu rc $?"
  grep -E "^  [a-zA-Z_].*\(|Duration|Elapsed Cycles|Registers Per|Block Size|Grid Size|Achieved Occupancy|Theoretical Occ|Memory Throughput|DRAM Throughput|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Stall" \
    "$OUT/ncu_decode_attn.txt" | head -90
  stamp 38 "ncu done"
  ;;
39|40)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp "$PART" "kernels built"
  COLUMNS=200 timeout 100 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_decode_attn_gpu.py \
    > "$OUT/gpu_tests_attn.log" 2>&1; tail -n 15 "$OUT/gpu_tests_attn.log"
  stamp "$PART" "decode-attention GPU tests done"
  timeout 60 python3 benchmarks/probe_decode_attn.py --json "$OUT/probe_decode_attn.json" 2>&1 \
    | tee "$OUT/probe_decode_attn.log"
  timeout 60 python3 benchmarks/bench_decode_attn.py --json "$OUT/decode_attn.json" 2>&1 | tee "$OUT/decode_attn.log"
  stamp "$PART" "decode attention timed"
  timeout $(( 560 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --decode-attn \
    --json "$OUT/rollout_7b_decode_attn.json" 2>&1 | tee "$OUT/bench_rollout_7b_decode_attn.log" | grep -v '^{'
  stamp "$PART" "decode-attention rollouts done"
  ;;
41)
  # prepared in session 18, not yet run: why decode attention in our kernel loses with an adapter (PDL on / off)
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build; stamp 41 "kernels built"
  timeout $(( 560 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --decode-attn-lora \
    --json "$OUT/rollout_7b_attn_lora.json" 2>&1 | tee "$OUT/bench_rollout_7b_attn_lora.log" | grep -v '^{'
  stamp 41 "decode-attention adapter rollouts and profiles done"
  ;;
42)
  # session 19 (ran once, H200, benchmarks/results/s19/): session 18's cluster / PDL / decode-attention GPU tests
  # and the gate/up weight's L2 prefetch (probe and rollouts), measured slower; the prefetch code was removed
  # after commit 0d9c6d9, which still runs this part
  stamp 42 "the L2-prefetch code is in commit 0d9c6d9 only: check it out to run this part"; exit 2
  ;;
43)
  # session 20: where a small-M launch spends its time (benchmarks/probe_timeline.py: per-CTA %globaltimer stamps in
  # the probe build of the kernel), in chains of one shape and in a 7B-shape decode step; sm_90a code only
  sm90_start
  QERL_KERNEL_TIMELINE=1 python3 -c "from qerl_cli import kernel; print('timeline build:', kernel.available(), \
    kernel.build_error())" > "$OUT/build_timeline.log" 2>&1 &
  build; wait; cat "$OUT/build_timeline.log"; stamp 43 "both builds done"
  COLUMNS=200 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
    tests/test_kernel.py -k "silu" tests/test_engine_gpu.py > "$OUT/gpu_tests_silu.log" 2>&1
  tail -n 15 "$OUT/gpu_tests_silu.log"; stamp 43 "pair-mode and engine GPU tests done"
  timeout 150 python3 benchmarks/bench_rollout.py --skip-smollm2 --silu-in-kernel \
    --json "$OUT/rollout_7b_silu.json" 2>&1 | tee "$OUT/bench_rollout_7b_silu.log" | grep -v '^{'
  stamp 43 "SiLU-in-kernel rollouts done"
  timeout $(( ${T43:-560} - $(date +%s) + t0 )) python3 benchmarks/probe_timeline.py --ms "${MS:-1,8,16}" \
    --json "$OUT/timeline.json" 2>&1 | tee "$OUT/timeline.log"
  stamp 43 "timeline probe done"
  ;;
45)
  # session 20, prepared: the timeline probe alone (sm_90a code only): chains and a 7B decode step, with the
  # stream-K blocks that summed before their last segment counted (do mid-kernel sums make the late blocks late?)
  sm90_start
  QERL_KERNEL_TIMELINE=1 build; stamp 45 "probe build done"
  timeout $(( 560 - $(date +%s) + t0 )) python3 benchmarks/probe_timeline.py --ms "${MS:-1,8,16}" \
    --json "$OUT/timeline.json" 2>&1 | tee "$OUT/timeline.log"
  stamp 45 "timeline probe done"
  ;;
46)
  sm90_start
  QERL_KERNEL_TIMELINE=1 build; stamp 46 "probe build done"
  python3 -c "from qerl_cli import kernel; print('normal build:', kernel.available(), kernel.build_error())" \
    > "$OUT/build_normal.log" 2>&1 &
  timeout $(( 400 - $(date +%s) + t0 )) python3 benchmarks/probe_timeline.py --ms "${MS:-1,8,16}" --no-pdl-ms "" \
    --grids "${GRIDS:-132,198}" --raw "$OUT/timeline_raw.npz" --json "$OUT/timeline.json" 2>&1 | tee "$OUT/timeline.log"
  stamp 46 "timeline probe done"
  wait; cat "$OUT/build_normal.log"
  COLUMNS=200 timeout $(( ${T46:-560} - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rf \
    --tb=short tests/test_engine_gpu.py > "$OUT/gpu_tests_engine.log" 2>&1
  tail -n 8 "$OUT/gpu_tests_engine.log"; stamp 46 "engine GPU tests done"
  ;;
47)
  sm90_start
  build; stamp 47 "build done"
  timeout $(( 540 - $(date +%s) + t0 )) python3 benchmarks/probe_partition.py --ms "${MS:-1,8,16}" \
    --json "$OUT/partition.json" 2>&1 | tee "$OUT/partition.log"
  stamp 47 "partition probe done"
  ;;
48)
  sm90_start
  build; stamp 48 "build done"
  COLUMNS=200 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    tests/test_engine_gpu.py tests/test_lora_in_kernel_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 48 "GPU tests done"
  timeout 150 python3 benchmarks/bench_rollout.py --skip-smollm2 --v2-aligned --json "$OUT/rollout_7b_aligned.json" 2>&1 \
    | tee "$OUT/bench_rollout_7b_aligned.log" | grep -v '^{' | grep -v '━\|──'
  stamp 48 "aligned rollouts done"
  timeout $(( 580 - $(date +%s) + t0 )) python3 benchmarks/bench_kernel.py --models qwen2.5-7b,qwen2.5-32b \
    --ms "${MS:-1,8,16}" --json "$OUT/kernel.json" > "$OUT/bench_kernel.log" 2>&1
  tail -n 40 "$OUT/bench_kernel.log"; stamp 48 "kernel bench done"
  ;;
49)
  sm90_start
  build; stamp 49 "build done"
  timeout 200 python3 benchmarks/probe_partition.py --shapes gate_up,down --variants v2w8,v2w10 --maxp 600 \
    --json "$OUT/partition.json" 2>&1 | tee "$OUT/partition.log"
  stamp 49 "partition probe done"
  COLUMNS=200 timeout $(( 500 - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
    tests/test_kernel.py -k "small_m or aligned or auto_variant or silu" > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 49 "GPU tests done"
  ;;
50)
  sm90_start
  build; stamp 50 "build done"
  COLUMNS=200 timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    tests/test_engine_gpu.py tests/test_lora_in_kernel_gpu.py tests/test_fused_gpu.py tests/test_train_gpu.py \
    tests/test_calibrate_gpu.py tests/test_decode_attn_gpu.py tests/test_extension_errors_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 50 "GPU tests done"
  timeout 150 python3 benchmarks/bench_rollout.py --skip-smollm2 --v2-aligned --json "$OUT/rollout_7b_aligned.json" 2>&1 \
    | tee "$OUT/bench_rollout_7b_aligned.log" | grep -v '^{' | grep -v '━\|──'
  stamp 50 "rollouts done"
  timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_kernel.py --models qwen2.5-7b,qwen2.5-32b \
    --ms "${MS:-1,8,16}" --json "$OUT/kernel.json" > "$OUT/bench_kernel.log" 2>&1
  tail -n 28 "$OUT/bench_kernel.log"; stamp 50 "kernel bench done"
  ;;
51)
  sm90_start
  QERL_KERNEL_TIMELINE=1 python3 -c "from qerl_cli import kernel; print('timeline build:', kernel.available(), \
    kernel.build_error())" > "$OUT/build_timeline.log" 2>&1 &
  build; wait; cat "$OUT/build_timeline.log"; stamp 51 "both builds done"
  COLUMNS=200 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_lora_in_kernel_gpu.py \
    tests/test_kernel.py -k "lora or silu or auto_variant or aligned" > "$OUT/gpu_tests.log" 2>&1
  tail -n 8 "$OUT/gpu_tests.log"; stamp 51 "GPU tests done"
  timeout $(( 500 - $(date +%s) + t0 )) python3 benchmarks/probe_timeline.py --ms 8 --no-pdl-ms "" \
    --raw "$OUT/timeline_raw.npz" --json "$OUT/timeline.json" 2>&1 | tee "$OUT/timeline.log"
  stamp 51 "timeline probe done"
  ;;
52)
  sm90_start
  build; stamp 52 "build done"
  COLUMNS=200 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    tests/test_lora_in_kernel_gpu.py -k "cluster_sums or aligned or auto_variant" > "$OUT/gpu_tests.log" 2>&1
  tail -n 8 "$OUT/gpu_tests.log"; stamp 52 "GPU tests done"
  timeout 60 python3 benchmarks/probe_partition.py --shapes qkv,o,down --cluster-ab --json "$OUT/cluster_ab.json" 2>&1 \
    | tee "$OUT/cluster_ab.log"
  stamp 52 "cluster A/B done"
  timeout $(( 270 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --v2-cluster \
    --json "$OUT/rollout_7b_cluster.json" 2>&1 | tee "$OUT/bench_rollout_7b_cluster.log" | grep -v '^{' | grep -v '━\|──'
  stamp 52 "rollouts done"
  ;;
53)
  sm90_start
  build; stamp 53 "build done"
  COLUMNS=200 timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_engine_gpu.py \
    tests/test_kernel.py tests/test_lora_in_kernel_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 53 "GPU tests done"
  timeout $(( 580 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --v2-aligned \
    --json "$OUT/rollout_7b_aligned.json" 2>&1 | tee "$OUT/bench_rollout_7b_aligned.log" | grep -v '^{' | grep -v '━\|──'
  stamp 53 "rollouts done"
  ;;
55)
  # session 22: the rotary inside the decode attention kernel (fused.rope_decode_attn) and auto's v2w8 rule at M <= 16
  sm90_start
  build; stamp 55 "build done"
  COLUMNS=200 timeout 260 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_decode_attn_gpu.py \
    tests/test_fused_gpu.py tests/test_engine_gpu.py tests/test_kernel.py > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 55 "GPU tests done"
  timeout 200 python3 benchmarks/bench_rollout.py --skip-smollm2 --rope-in-attn --json "$OUT/rollout_7b_rope.json" 2>&1 \
    | tee "$OUT/bench_rollout_7b_rope.log" | grep -v '^{' | grep -v '━\|──'
  stamp 55 "rollouts done"
  timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_kernel.py --models qwen2.5-7b,qwen2.5-32b \
    --ms "${MS:-1,8,16}" --json "$OUT/kernel.json" > "$OUT/bench_kernel.log" 2>&1
  tail -n 16 "$OUT/bench_kernel.log"; stamp 55 "kernel bench done"
  ;;
58)
  # session 22: the gate/up group's LoRA term inside the SiLU·mul pair kernel (linear_silu with hs, bs)
  sm90_start
  build; stamp 58 "build done"
  COLUMNS=200 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    tests/test_engine_gpu.py tests/test_lora_in_kernel_gpu.py -k "silu or lora or shrink" > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 58 "GPU tests done"
  timeout $(( ${T58:-400} - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --silu-lora \
    --json "$OUT/rollout_7b_silu_lora.json" 2>&1 | tee "$OUT/bench_rollout_7b_silu_lora.log" | grep -v '^{' | grep -v '━\|──'
  stamp 58 "rollouts done"
  ;;
65)
  # session 23: Nsight Compute on the tiled kernels (tiles NCU_VARIANTS; 7B gate/up and q/k/v at M = NCU_M):
  # speed of light, warp stall reasons, pipe use, memory tables, occupancy, scheduler
  sm90_start
  build; stamp 65 "build done"
  timeout 300 ncu --clock-control none --kernel-name regex:"nvfp4_(tc|wg)" --launch-skip 1 --launch-count 6 \
    --section SpeedOfLight --section WarpStateStats --section ComputeWorkloadAnalysis --section SchedulerStats \
    --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    python3 benchmarks/ncu_variants.py --m ${NCU_M:-1024} --variants ${NCU_VARIANTS:-tc1,tc3,tc2} --shapes gate_up,qkv --launches 2 \
    > "$OUT/ncu_tiled.txt" 2>&1; echo "ncu rc $?"
  grep -E "nvfp4_tc_kernel|nvfp4_wg_kernel|Duration|Throughput|Pipe|Stall|Issued Warp|Eligible|Active Warps|Registers|Achieved Occ|L2 Hit|Mem Busy|Max Bandwidth|One or More|No Eligible|Executed Ipc|Bank" \
    "$OUT/ncu_tiled.txt" | cut -c1-160 | head -n 150
  stamp 65 "ncu done"
  ;;
78)
  # session 33: the default build, every test of tests/test_engine_gpu.py, test_decode_attn_gpu.py and test_train_gpu.py (the
  # decode steps' attention over buckets of the cache's slots: graph per bucket, eager, kept, policy;
  # fused.decode_attn_takes against the launcher) and the dequantize_many test, then bench_rollout.py --profile
  # --skip-7b: the SmolLM2 rows, at batch 256 each engine's default against attention over the whole cache (and
  # NVFP4 against one dequantize launch per projection), interleaved three times, and the decode-only profiles of
  # the 256-token rollout without PDL, for at most T78 (default 560) seconds
  sm90_start
  build; stamp 78 "build done"
  COLUMNS=200 timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_engine_gpu.py \
    tests/test_decode_attn_gpu.py tests/test_train_gpu.py tests/test_kernel.py -k "not test_kernel or dequantize_many" \
    > "$OUT/gpu_tests_buckets.log" 2>&1; tail -n 12 "$OUT/gpu_tests_buckets.log"
  stamp 78 "GPU tests done"
  smollm2_profile 78 "${T78:-560}" buckets
  ;;
77)
  # session 33: the default build, the GPU tests of the per-layer dequantize (kernel.dequantize_many bit-exact with
  # dequantize; the engine's tokens and log-probs bit-identical to one dequantize per projection) beside the
  # engine's graph and PDL tests, then bench_rollout.py --profile --skip-7b: the SmolLM2 shapes at batch 64 and 256
  # (ours NVFP4 / bf16, HF generate), NVFP4 at batch 256 with the per-layer dequantize against one launch per
  # projection (interleaved three times), the b256 steps profiled without PDL, for at most T77 (default 560) seconds
  sm90_start
  build; stamp 77 "build done"
  COLUMNS=200 timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    tests/test_engine_gpu.py -k "dequantize_many or dequant_layer or dequantize_bit_exact or decode_equals_eager or pdl_on_off" \
    > "$OUT/gpu_tests_dequant_layer.log" 2>&1; tail -n 6 "$OUT/gpu_tests_dequant_layer.log"
  stamp 77 "GPU tests done"
  smollm2_profile 77 "${T77:-560}" dequant
  ;;
76)
  # session 31 (run in session 32; bench_rollout.py's --profile arms and profiles are session 33's since): the
  # default build, then bench_rollout.py --profile --skip-7b: the SmolLM2
  # shapes' rows at batch 64 and 256 (ours NVFP4 / bf16, HF generate) and the decode step at batch 256 profiled
  # in bf16 and NVFP4 (where the 2.5-2.9 ms per step go, against HF's 14.7: the 10x target), with session 32's
  # arm at batch 256: decode attention in our kernel past one wave against the default (SDPA there), interleaved,
  # with the tiled tensor-core NVFP4 kernel at M = 256 as a further arm, and the NVFP4 step profiled with our
  # attention kernel, for at most T76 (default 400) seconds
  sm90_start
  build; stamp 76 "build done"
  COLUMNS=200 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_decode_attn_gpu.py \
    -k engine_decode_attn_same_policy > "$OUT/gpu_tests_attn_engine.log" 2>&1; tail -n 6 "$OUT/gpu_tests_attn_engine.log"
  stamp 76 "engine attention GPU test done"
  smollm2_profile 76 "${T76:-400}" profile
  ;;
75)
  # session 31: the default build, then bench_rollout.py with no arm flag (session 30's fixed bench: one model
  # resident per row, HF warmed on the measured shapes): SmolLM2 shapes (random weights: eos is ignored, so the
  # speed does not depend on them) at batch 64 and 256 with HF generate, then the 7B shapes at batch 8 and 64 with
  # HF generate and the ablations, for at most T75 (default 560) seconds (every row is saved as it ends)
  sm90_start
  build; stamp 75 "build done"
  COLUMNS=200 timeout $(( ${T75:-560} - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py \
    --json "$OUT/rollout_full.json" 2>&1 | tee "$OUT/bench_rollout_full.log" | grep -v '^{' | grep -v '━\|──'
  stamp 75 "rollouts done"
  ;;
74)
  # session 30: the default build, then every GPU test (-m gpu over tests/), for at most T74 (default 560) seconds
  sm90_start
  build; stamp 74 "build done"
  COLUMNS=200 timeout $(( ${T74:-560} - $(date +%s) + t0 )) python3 -m pytest -m gpu -q -p no:cacheprovider -rfs \
    --tb=short tests/ > "$OUT/gpu_tests_all.log" 2>&1; tail -n 25 "$OUT/gpu_tests_all.log"; stamp 74 "GPU tests done"
  ;;
72)
  # session 29: on an H200 (issue 5's 3,000 tok/s target is set there), the default build: the kept-graph GPU
  # test, then bench_rollout.py --keep-graph (7B shapes, batch 8: bf16, NVFP4, NVFP4 + rank-32 adapter, each kept
  # against a capture per call, interleaved), for at most T72 (default 400) seconds
  sm90_start
  build; stamp 72 "build done"
  COLUMNS=200 timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_engine_gpu.py \
    -k kept_decode_graph > "$OUT/gpu_tests_kept.log" 2>&1; tail -n 6 "$OUT/gpu_tests_kept.log"; stamp 72 "GPU test done"
  COLUMNS=200 timeout $(( ${T72:-400} - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --keep-graph \
    --skip-smollm2 --json "$OUT/rollout_7b_keep.json" 2>&1 | tee "$OUT/bench_rollout_7b_keep.log" | grep -v '^{' \
    | grep -v '━\|──'
  stamp 72 "rollouts done"
  ;;
73)
  # session 29 (prepared, not yet run): the stream-K kernels' rolling L2 prefetch, in a build with
  # -DQERL_V2_PREFETCH_LOOP (the default build has none of it): its bit-identity GPU test, the distances PFS beside
  # cuBLAS at MS (ab_kernel.py --prefetch), then the 7B-shape rollouts kept with and without it (PFARM tiles)
  sm90_start
  export QERL_KERNEL_ARCH_FLAGS="$QERL_KERNEL_ARCH_FLAGS -DQERL_V2_PREFETCH_LOOP"
  build; stamp 73 "prefetch build done"
  COLUMNS=200 timeout 90 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    -k v2_prefetch > "$OUT/gpu_tests_prefetch.log" 2>&1; tail -n 6 "$OUT/gpu_tests_prefetch.log"; stamp 73 "GPU tests done"
  timeout 180 python3 benchmarks/ab_kernel.py --prefetch ${PFS:-0,16,32} --ms ${MS:-1,8,16} \
    --json "$OUT/ab_prefetch.json" 2>&1 | grep -v Warning | tee "$OUT/ab_prefetch.log"
  stamp 73 "prefetch compared"
  COLUMNS=200 timeout $(( ${T73:-585} - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --keep-graph \
    --skip-smollm2 --prefetch-arm ${PFARM:-16} --json "$OUT/rollout_7b_prefetch.json" 2>&1 \
    | tee "$OUT/bench_rollout_7b_prefetch.log" | grep -v '^{' | grep -v '━\|──'
  stamp 73 "rollouts done"
  ;;
70)
  # session 26 (branch keep-graph): part 69's build and engine GPU tests alone, for a call on little device time
  grep -q -- "--keep-graph" benchmarks/bench_rollout.py \
    || { echo "part 70 needs bench_rollout.py --keep-graph (main since session 28)" >&2; exit 2; }
  sm90_start
  build; stamp 70 "build done"
  COLUMNS=200 timeout 60 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_engine_gpu.py \
    -k kept_decode_graph > "$OUT/gpu_tests_kept.log" 2>&1; tail -n 12 "$OUT/gpu_tests_kept.log"; stamp 70 "kept-graph test done"
  COLUMNS=200 timeout "${T70:-100}" python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_engine_gpu.py \
    -k "not kept_decode_graph" > "$OUT/gpu_tests_engine.log" 2>&1; tail -n 12 "$OUT/gpu_tests_engine.log"
  stamp 70 "engine GPU tests done"
  ;;
69)
  # session 25: the engine keeps its decode graph between rollout calls of the same shapes (Engine.keep_graph)
  grep -q -- "--keep-graph" benchmarks/bench_rollout.py \
    || { echo "part 69 needs bench_rollout.py --keep-graph (main since session 28)" >&2; exit 2; }
  sm90_start
  build; stamp 69 "build done"
  COLUMNS=200 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_engine_gpu.py \
    > "$OUT/gpu_tests_engine.log" 2>&1; tail -n 12 "$OUT/gpu_tests_engine.log"; stamp 69 "engine GPU tests done"
  timeout 260 python3 benchmarks/bench_rollout.py --keep-graph --skip-smollm2 --json "$OUT/rollout_7b_keep.json" 2>&1 \
    | tee "$OUT/bench_rollout_7b_keep.log" | grep -v '^{' | grep -v '━\|──'
  stamp 69 "rollouts done"
  left=$(( 590 - $(date +%s) + t0 )); [ "$left" -gt "${T69:-200}" ] && left=${T69:-200}
  COLUMNS=200 timeout "$left" python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short \
    tests/test_decode_attn_gpu.py tests/test_fused_gpu.py tests/test_lora_in_kernel_gpu.py tests/test_train_gpu.py \
    > "$OUT/gpu_tests_rest.log" 2>&1; tail -n 12 "$OUT/gpu_tests_rest.log"; stamp 69 "other GPU tests done"
  ;;
67)
  # session 24: build, issue 4's small-M kernel table (M = 1-32, both models; no tiled columns) and issue 5's
  # 7B-shape rollout table (our engine NVFP4 and bf16, HF generate; batch 8 and 64), for at most T67 seconds
  sm90_start
  build; stamp 67 "build done"
  timeout 100 python3 benchmarks/bench_kernel.py --models qwen2.5-7b,qwen2.5-32b --ms "${MS:-1,2,4,8,16,32}" \
    --tiled-from 100000 --json "$OUT/kernel.json" > "$OUT/bench_kernel.log" 2>&1
  grep "^|" "$OUT/bench_kernel.log" | cut -d"|" -f2-13 | tail -n 50; stamp 67 "kernel bench done"
  timeout $(( ${T67:-450} - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 \
    --json "$OUT/rollout_7b.json" 2>&1 | tee "$OUT/bench_rollout_7b.log" | grep -v '^{' | grep -v '━\|──'
  stamp 67 "rollouts done"
  ;;
66)
  # session 24: build, the GPU tests of the tiled kernels (now with the wgmma tiles 4-7) and the mid/large-M kernel
  # tests, then the kernel bench from M = 64 to 4096 with every tile forced beside mma / dequantize + cuBLAS
  sm90_start
  build; stamp 66 "build done"
  COLUMNS=200 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    -k "${TESTS:-tiled or mid_m or large_m or all_codes}" > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 66 "GPU tests done"
  timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_kernel.py --models ${MODELS:-qwen2.5-7b,qwen2.5-32b} \
    --ms "${MS:-64,128,256,512,1024,2048,4096}" --tiled-cfgs "${TCFGS:-4,5,6,7}" --json "$OUT/kernel.json" \
    > "$OUT/bench_kernel.log" 2>&1
  grep -v "^|" "$OUT/bench_kernel.log" | cut -c1-400 | tail -n 60; stamp 66 "kernel bench done"
  ;;
64)
  # session 23: build, the tiled tensor-core kernel's GPU tests (path 2) and the mid/large-M kernel tests, then the
  # kernel bench from M = 64 to 4096 with the tiled kernel's three tiles forced beside mma / dequantize + cuBLAS
  sm90_start
  build; stamp 64 "build done"
  COLUMNS=200 timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    -k "tiled or mid_m or large_m or all_codes" > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 64 "GPU tests done"
  timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_kernel.py --models ${MODELS:-qwen2.5-7b,qwen2.5-32b} \
    --ms "${MS:-64,128,256,512,1024,2048,4096}" --json "$OUT/kernel.json" > "$OUT/bench_kernel.log" 2>&1
  grep -v "^|" "$OUT/bench_kernel.log" | cut -c1-400 | tail -n 60; stamp 64 "kernel bench done"
  ;;
63)
  # prepared in session 22 for the next session: the GPU tests of the review fixes made after the last device call
  sm90_start
  build; stamp 63 "build done"
  COLUMNS=200 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_decode_attn_gpu.py \
    tests/test_engine_gpu.py tests/test_lora_in_kernel_gpu.py tests/test_kernel.py > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 63 "GPU tests done"
  ;;
60)
  sm90_start
  build; stamp 60 "build done"
  COLUMNS=200 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    -k "linear_silu" > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 60 "GPU tests done"
  ;;
59)
  # session 22: part 58's pair-mode LoRA kernel test again (its reference call had autograd on), then the
  # no-adapter SiLU·mul-in-kernel A/B on the final pair kernels
  sm90_start
  build; stamp 59 "build done"
  COLUMNS=200 timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    -k "linear_silu" > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 59 "GPU tests done"
  timeout $(( ${T59:-280} - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --silu-in-kernel \
    --json "$OUT/rollout_7b_silu.json" 2>&1 | tee "$OUT/bench_rollout_7b_silu.log" | grep -v '^{' | grep -v '━\|──'
  stamp 59 "rollouts done"
  ;;
57)
  # session 22, final main: the GPU test files part 55 did not run (LoRA term, train, calibrate, extension errors),
  # then the 7B-shape rollout at batch 8 without and with a rank-32 adapter
  sm90_start
  build; stamp 57 "build done"
  COLUMNS=200 timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_lora_in_kernel_gpu.py \
    tests/test_train_gpu.py tests/test_calibrate_gpu.py tests/test_extension_errors_gpu.py > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 57 "GPU tests done"
  timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --lora-only --profile --skip-smollm2 \
    --json "$OUT/rollout_7b_lora.json" 2>&1 | tee "$OUT/bench_rollout_7b_lora.log" | grep -v '^{' | grep -v '━\|──'
  stamp 57 "7B LoRA rollout bench and profile done"
  ;;
56)
  # session 22: the slab kernel (one CTA per row block over the whole K; auto's choice for q/k/v and o at M <= 16)
  sm90_start
  build; stamp 56 "build done"
  COLUMNS=200 timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short tests/test_kernel.py \
    tests/test_lora_in_kernel_gpu.py -k "slab or auto_variant or small_m or cluster_sums or bias or graph or pdl_chain" \
    > "$OUT/gpu_tests.log" 2>&1
  tail -n 12 "$OUT/gpu_tests.log"; stamp 56 "GPU tests done"
  timeout 100 python3 benchmarks/bench_kernel.py --models qwen2.5-7b,qwen2.5-32b --ms "${MS:-1,8,16}" \
    --json "$OUT/kernel.json" > "$OUT/bench_kernel.log" 2>&1
  tail -n 26 "$OUT/bench_kernel.log"; stamp 56 "kernel bench done"
  timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_rollout.py --skip-smollm2 --slab \
    --json "$OUT/rollout_7b_slab.json" 2>&1 | tee "$OUT/bench_rollout_7b_slab.log" | grep -v '^{' | grep -v '━\|──'
  stamp 56 "rollouts done"
  ;;
54)
  export QERL_KERNEL_ARCH_FLAGS="-gencode=arch=compute_90a,code=sm_90a"
  build; stamp 54 "build (cached on a warm machine) done"
  timeout $(( 585 - $(date +%s) + t0 )) python3 benchmarks/bench_kernel.py --models qwen2.5-7b,qwen2.5-32b \
    --ms "${MS:-1,2,4,8,16,32,64,128,256,1024,4096}" --json "$OUT/kernel.json" > "$OUT/bench_kernel.log" 2>&1
  tail -n 50 "$OUT/bench_kernel.log"; stamp 54 "kernel bench done"
  ;;
8)
  build; stamp 8 "kernels built"
  lora_rollout 200 8
  ;;
7)
  build; stamp 7 "kernels loaded"
  [ -n "${TESTS:-}" ] && timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf $TESTS 2>&1 | tail -8 \
    | tee "$OUT/gpu_tests.log"
  timeout 420 python3 benchmarks/bench_rollout.py --skip-smollm2 --profile --json "$OUT/rollout_7b_h200.json" 2>&1 \
    | tee "$OUT/bench_rollout_7b.log" | grep -v '^{'
  stamp 7 "7B rollout bench done"
  ;;
5)
  build; stamp 5 "kernels built"
  timeout 120 python3 -m pytest -m gpu -q -p no:cacheprovider -rf tests/test_fused_gpu.py tests/test_engine_gpu.py \
    2>&1 | tail -15 | tee "$OUT/gpu_tests.log"
  stamp 5 "GPU tests done"
  lora_rollout 200 5
  ;;
1)
  mkdir -p /root/smol && [ -f .carry/p1/part.aa ] && cp .carry/p1/part.aa /root/smol/ && stamp 1 "first half of the GGUF parked"
  nvidia-smi --query-gpu=name,driver_version,memory.used,clocks.sm --format=csv | tee "$OUT/gpu.txt"
  build
  stamp 1 "kernel built"
  # TESTS: the GPU test files to run (default all of them)
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -rf ${TESTS:-tests/test_kernel.py tests/test_engine_gpu.py \
    tests/test_fused_gpu.py tests/test_train_gpu.py tests/test_calibrate_gpu.py} 2>&1 | tail -40 | tee "$OUT/gpu_tests.log"
  stamp 1 "GPU tests done"
  timeout 240 python3 benchmarks/bench_rollout.py --skip-smollm2 --profile --json "$OUT/rollout_7b_h200.json" 2>&1 \
    | tee "$OUT/bench_rollout_7b.log" | grep -v '^{'
  stamp 1 "7B rollout bench done"
  ;;
2)
  cat /root/smol/part.aa .carry/p2/part.ab > $GGUF && sha256sum $GGUF
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/whl/*.whl
  stamp 2 "GGUF assembled, gguf installed"
  M=$W/matrix; mkdir -p $M
  set -e
  CAL="calibrate $GGUF --data tests/data/gsm8k/train.jsonl --field question,answer --samples 64 --seq-len 512 --no-progress -o $M/calib"
  { $QERL $CAL --device ${CALIB_DEVICE:-cuda} || { rm -rf $M/calib; $QERL $CAL --device cpu; }; } 2>&1 | tail -15 | tee "$OUT/calibrate.log"
  $QERL quantize $GGUF --calib $M/calib --no-progress -o $M/quant 2>&1 | tail -5
  $QERL pack $M/quant --no-progress -o $M/packed 2>&1 | tail -5
  $QERL verify $M/packed --no-progress -o $M/verify 2>&1 | tail -25 | tee "$OUT/verify.log"
  set +e
  stamp 2 "calibrate -> quantize -> pack -> verify done"
  (cd examples/matrix && timeout 150 python3 match_temperature.py $M/packed $GGUF --out $M/entropy \
     --temperatures 1.0,1.05,1.1,1.15,1.2,1.3 2>&1 | tail -3 | tee "$OUT/hot-temperature.log")
  t=$(tail -1 "$OUT/hot-temperature.log"); printf 'temperature = %s\n' "$t" > $M/hot.toml; cat $M/hot.toml
  stamp 2 "entropy-matched temperature"
  # every arm of every seed side by side (equal budgets under equal sharing of the GPU); runs on after this
  # call returns (own process session) and part 3 waits for it
  rm -f $W/runs.rc
  OMP_NUM_THREADS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True setsid bash -c "cd examples/matrix && make -k -j$(( 5 * $(echo ${SEEDS:-0 1} | wc -w) )) runs \
    SEEDS='${SEEDS:-0 1}' OUT=$M MODEL=$GGUF QERL='$QERL' DATA=$PWD/tests/data/gsm8k/train.jsonl \
    > $W/runs.log 2>&1; echo \$? > $W/runs.rc" < /dev/null > /dev/null 2>&1 &
  stamp 2 "matrix runs of seeds ${SEEDS:-0 1} started"
  ;;
3)
  M=$W/matrix
  # a fresh machine (the last one was handed back) has no runs to wait for: say so at once, spend nothing
  [ -f $W/runs.log ] || { stamp 3 "no matrix runs on this machine (handed back since part 2?): run parts 1 and 2 again"; exit 4; }
  while [ ! -f $W/runs.rc ] && [ $(( $(date +%s) - t0 )) -lt ${WAIT_S:-540} ]; do sleep 10; done
  tail -30 $W/runs.log
  [ -f $W/runs.rc ] || { stamp 3 "runs still going; call part 3 again"; exit 3; }
  stamp 3 "matrix runs finished, make exit $(cat $W/runs.rc)"
  $QERL report $M/*-s*/run --target-accuracy 0.6 -o $M/report-runs --force 2>&1 | tail -20
  tar czf "$OUT/matrix_runs.tgz" -C $M --exclude='step-*' --exclude=calib --exclude=quant --exclude=packed \
    --exclude=entropy $(cd $M && ls -d *-s* report-runs hot.toml verify 2>/dev/null)
  cp $M/report-runs/curves.png "$OUT/curves_runs.png" 2>/dev/null
  stamp 3 "report written"
  ;;
4)
  [ -f $W/runs.rc ] || { stamp 4 "no finished matrix runs on this machine: parts 2 and 3 first"; exit 4; }
  SEEDS=${2:-0 1}; M=$W/matrix; export OMP_NUM_THREADS=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
  (cd examples/matrix && make -k -j$(( 5 * $(echo $SEEDS | wc -w) )) all SEEDS="$SEEDS" OUT=$M MODEL=$GGUF QERL="$QERL" \
     DATA=$PWD/../../tests/data/gsm8k/train.jsonl) 2>&1 | tail -40
  tar czf "$OUT/matrix_report.tgz" -C $M report $(cd $M && ls -d *-s*/eval 2>/dev/null)
  cp $M/report/curves.png "$OUT/curves_matrix.png" 2>/dev/null
  stamp 4 "matrix evals and report written"
  # the GPU is free again: the real-SmolLM2 rollout bench (our engine NVFP4 / bf16 vs HF generate, greedy match)
  timeout 240 python3 benchmarks/bench_rollout.py --smollm2 $GGUF --skip-7b --json "$OUT/rollout_smollm2_h200.json" \
    2>&1 | tee "$OUT/bench_rollout_smollm2.log" | grep -v '^{'
  stamp 4 "SmolLM2 rollout bench done"
  ;;
esac
