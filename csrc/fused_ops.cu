// Fused elementwise kernels of a decoder layer on bf16 rows (the CUDA rollout engine's no-grad path).
//
// Each one replaces a chain of small torch kernels and rounds where that chain rounds, so its output equals
// the chain's (bit-exact for silu_mul and rope_kv; add_rmsnorm reduces the squares in another order, so its
// normalizer can differ in the last fp32 bit and an output by one bf16 unit):
//   * add_rmsnorm: s = bf16(h + d) (the residual, written out), x = bf16(float(s) * rstd * float(w)),
//     rstd = rsqrt(mean(float(s)^2) + eps); w shared [H] or one row per group of rows, bf16 or fp32 (AQN's
//     noisy scales stay fp32: rounded to bf16, small draws would vanish); d optional.
//   * silu_mul:    out = bf16(float(bf16(silu(float(g)))) * float(u)), g and u strided views of one fused
//     gate/up output.
//   * rope_kv:     from a fused q/k/v projection row, rotary (HF rotate_half convention:
//     bf16(bf16(x * cos) + bf16(rotate_half(x) * sin))) on q and k; q goes to q_out [B, H, T, D], k and v are
//     written into the KV cache [B, KV, S, D] at slots slot0 + t (slot0 read on the device, so a CUDA graph
//     can replay the step for a new slot).
// Vector width: 8 bf16 (16 bytes) per access; the wrappers require widths and strides that allow it.
// Each kernel lets the next one on the stream launch at once and waits for the one before it before touching
// memory (programmatic dependent launch, csrc/pdl.cuh): a launch's latency hides behind the previous kernel.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <map>
#include <mutex>
#include <utility>
#include <vector>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "check.cuh"
#include "pdl.cuh"

#ifndef QERL_NO_TORCH
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#endif

namespace qerl_fused {

using bf16 = __nv_bfloat16;

struct alignas(16) Vec8 {
  bf16 v[8];
};

__device__ __forceinline__ Vec8 ld8(const bf16* p) { return *reinterpret_cast<const Vec8*>(p); }
__device__ __forceinline__ void st8(bf16* p, const Vec8& x) { *reinterpret_cast<Vec8*>(p) = x; }
__device__ __forceinline__ float f(bf16 x) { return __bfloat162float(x); }
// a 16-byte asynchronous copy global -> shared (cp.async, cached at L2 only)
__device__ __forceinline__ void cp_async16(bf16* smem, const bf16* g) {
  const uint32_t sa = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sa), "l"(g) : "memory");
}
__device__ __forceinline__ bf16 b(float x) { return __float2bfloat16_rn(x); }

// one block per row; each thread keeps its 8-wide chunks of the summed row in registers (H <= 8 * 4 * threads)
constexpr int kNormThreads = 256;
constexpr int kNormChunks = 4;

// eight scales as floats: bf16 scales (the clean norm weights) or fp32 ones (AQN's noisy draws)
__device__ __forceinline__ void ld_scale8(const bf16* p, float (&o)[8]) {
  const Vec8 v = ld8(p);
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = f(v.v[j]);
}
__device__ __forceinline__ void ld_scale8(const float* p, float (&o)[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], c = reinterpret_cast<const float4*>(p)[1];
  o[0] = a.x, o[1] = a.y, o[2] = a.z, o[3] = a.w, o[4] = c.x, o[5] = c.y, o[6] = c.z, o[7] = c.w;
}

// the RB sums acc[i] of a block's threads, each added over the block (lanes by shuffles, then the warps in
// order through shared memory), rounded to bf16 and stored as floats at out[i] for i < n (one thread each)
template <int THREADS, int RB>
__device__ __forceinline__ void block_sums_to_bf16(float (&acc)[RB], float* __restrict__ out, int n) {
  __shared__ float part[RB][THREADS / 32];
#pragma unroll
  for (int i = 0; i < RB; ++i) {
    float v = acc[i];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) part[i][threadIdx.x >> 5] = v;
  }
  __syncthreads();
  if (threadIdx.x < RB && static_cast<int>(threadIdx.x) < n) {
    float t = 0.f;
#pragma unroll
    for (int k = 0; k < THREADS / 32; ++k) t += part[threadIdx.x][k];
    out[threadIdx.x] = f(b(t));
  }
}

// LoRA shrink fused into the kernel that makes its input (decode steps): hs[row, r] = bf16(sum_k x[row, k] a[r, k])
// for the stacked A of the projections that read x. Block (row, j) takes the rank rows [RB j, RB j + RB): each
// block recomputes its row's x (the same sums in the same order: the same bits), block j == 0 alone writes it.
constexpr int kNormShrinkRB = 4;
constexpr int kSiluShrinkRB = 2;

template <typename W>
__global__ void __launch_bounds__(kNormThreads) add_rmsnorm_kernel(
    const bf16* __restrict__ h, const bf16* __restrict__ d, const W* __restrict__ w, int64_t w_stride,
    int rows_per_w, bf16* __restrict__ h_out, bf16* __restrict__ x_out, int width, float eps,
    const bf16* __restrict__ a, int R, float* __restrict__ hs) {
  qerl_pdl::trigger();
  constexpr int RB = kNormShrinkRB;
  const int r0 = blockIdx.y * RB;
  extern __shared__ __align__(16) bf16 as[];  // [RB][width]: a's rank rows of this block (with a)
  if (a) {  // a constant of the step: its copy into shared memory starts before the wait
    const int nr = min(RB, R - r0);
    for (int idx = threadIdx.x; idx < nr * (width / 8); idx += kNormThreads) {
      const int r = idx / (width / 8), k = 8 * (idx % (width / 8));
      cp_async16(as + r * width + k, a + (size_t)(r0 + r) * width + k);
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  qerl_pdl::wait();
  const bool writer = blockIdx.y == 0;
  const int64_t row = blockIdx.x;
  const bf16* hr = h + row * width;
  const bf16* dr = d ? d + row * width : nullptr;
  const W* wr = w + (row / rows_per_w) * w_stride;
  Vec8 s[kNormChunks];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < kNormChunks; ++c) {
    const int i = (c * kNormThreads + threadIdx.x) * 8;
    if (i < width) {
      Vec8 sv = ld8(hr + i);
      if (dr) {
        const Vec8 e = ld8(dr + i);
#pragma unroll
        for (int j = 0; j < 8; ++j) sv.v[j] = b(f(sv.v[j]) + f(e.v[j]));
        if (writer) st8(h_out + row * width + i, sv);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += f(sv.v[j]) * f(sv.v[j]);
      s[c] = sv;
    }
  }
  __shared__ float red[kNormThreads / 32];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float tot = 0.f;
#pragma unroll
  for (int k = 0; k < kNormThreads / 32; ++k) tot += red[k];
  const float rstd = rsqrtf(tot / static_cast<float>(width) + eps);
  if (a) {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncthreads();
  }
  float acc[RB];
#pragma unroll
  for (int i = 0; i < RB; ++i) acc[i] = 0.f;
#pragma unroll
  for (int c = 0; c < kNormChunks; ++c) {
    const int i = (c * kNormThreads + threadIdx.x) * 8;
    if (i < width) {
      float wv[8];
      ld_scale8(wr + i, wv);
      Vec8 o;
#pragma unroll
      for (int j = 0; j < 8; ++j) o.v[j] = b(wv[j] * (rstd * f(s[c].v[j])));
      if (writer) st8(x_out + row * width + i, o);
      if (a) {
#pragma unroll
        for (int r = 0; r < RB; ++r)
          if (r0 + r < R) {
            const Vec8 av = ld8(as + r * width + i);
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[r] += f(o.v[j]) * f(av.v[j]);
          }
      }
    }
  }
  if (a) block_sums_to_bf16<kNormThreads, RB>(acc, hs + row * R + r0, R - r0);
}

// one element of silu_mul: bf16(float(bf16(silu(float(g)))) * float(u))
__device__ __forceinline__ bf16 silu_mul1(bf16 g, bf16 u) {
  const float x = f(g);
  return b(f(b(x / (1.0f + expf(-x)))) * f(u));
}

__global__ void silu_mul_kernel(const bf16* __restrict__ g, const bf16* __restrict__ u, int64_t in_stride,
                                bf16* __restrict__ out, int64_t rows, int width) {
  qerl_pdl::trigger();
  qerl_pdl::wait();
  const int per_row = width / 8;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * per_row) return;
  const int64_t r = idx / per_row;
  const int i = static_cast<int>(idx - r * per_row) * 8;
  const Vec8 gv = ld8(g + r * in_stride + i), uv = ld8(u + r * in_stride + i);
  Vec8 o;
#pragma unroll
  for (int j = 0; j < 8; ++j) o.v[j] = silu_mul1(gv.v[j], uv.v[j]);
  st8(out + r * static_cast<int64_t>(width) + i, o);
}

// silu_mul of one row per block with the down projection's LoRA shrink (see kNormShrinkRB): block (row, j) makes
// the whole row (block j == 0 writes it) and hs[row, r] for the rank rows r of a in [RB j, RB j + RB); a's rows
// stream from L2 alongside g and u (too long to hold in registers), two 8-wide chunks per thread in flight
__global__ void __launch_bounds__(kNormThreads) silu_mul_shrink_kernel(
    const bf16* __restrict__ g, const bf16* __restrict__ u, int64_t in_stride, bf16* __restrict__ out, int width,
    const bf16* __restrict__ a, int R, float* __restrict__ hs) {
  qerl_pdl::trigger();
  constexpr int RB = kSiluShrinkRB;
  const int r0 = blockIdx.y * RB;
  const int nr = min(RB, R - r0);
  qerl_pdl::wait();
  const bool writer = blockIdx.y == 0;
  const int64_t row = blockIdx.x;
  const bf16* gr = g + row * in_stride;
  const bf16* ur = u + row * in_stride;
  float acc[RB];
#pragma unroll
  for (int i = 0; i < RB; ++i) acc[i] = 0.f;
#pragma unroll 2
  for (int k = threadIdx.x * 8; k < width; k += kNormThreads * 8) {
    const Vec8 gv = ld8(gr + k), uv = ld8(ur + k);
    Vec8 av[RB];
#pragma unroll
    for (int r = 0; r < RB; ++r)
      if (r < nr) av[r] = ld8(a + (size_t)(r0 + r) * width + k);
    Vec8 o;
#pragma unroll
    for (int j = 0; j < 8; ++j) o.v[j] = silu_mul1(gv.v[j], uv.v[j]);
    if (writer) st8(out + row * static_cast<int64_t>(width) + k, o);
#pragma unroll
    for (int r = 0; r < RB; ++r)
      if (r < nr)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[r] += f(o.v[j]) * f(av[r].v[j]);
  }
  block_sums_to_bf16<kNormThreads, RB>(acc, hs + row * R + r0, nr);
}

// LoRA terms of the engine's decode steps (M <= 16 rows), in two small PDL kernels instead of two cuBLAS matmuls
// (each of those often a gemm plus a split-K reduce, none overlapping its neighbours):
//   lora_shrink: h[m, r] = bf16(sum over k of x[m, k] * a[r, k])   (fp32 sums, h kept as fp32 of the bf16 value)
//   lora_expand: out[m, n] = bf16(float(y[m, n]) + sum over r of h[m, r] * float(bs[r, n]))
// which is addmm(y, x @ a^T, bs) with h = x @ a^T rounded to bf16 in between, as the cuBLAS chain rounds it.
// Both factors are constants of the decode step, so each kernel loads its factor slice before waiting for the
// kernel before it (PDL): what is left after the wait is one round trip for the activations, the arithmetic,
// and (shrink) one ticket and one gather of the K-split partials. Every sum runs in a fixed order: the result
// does not depend on scheduling. bs may be block-diagonal (a fused group's members, each its own rank rows):
// the expand kernel reads only the rows of its column's member (LoraSegs), not the zero blocks.
constexpr int kLoraMaxM = 16;
constexpr int kShrinkWarps = 8;
constexpr int kShrinkRowsPerWarp = 2;
constexpr int kShrinkRows = kShrinkWarps * kShrinkRowsPerWarp;  // rows of a per block
constexpr int kShrinkStep = 256;                                // inputs per step: 8 per lane
constexpr int kShrinkMaxTiles = 256;                            // row tiles (R <= 4096): one ticket each
constexpr int kExpandThreads = 128;                             // 32 output column pairs per block
constexpr int kExpandQ = 4;                                     // threads per column pair (rows split four ways)
constexpr int kExpandBatch = 8;                                 // rows per thread whose loads are in flight together
constexpr int kLoraMaxSegs = 8;

// column ranges of bs with their nonzero rows: columns [col_end[i-1], col_end[i]) use rows [row_begin[i],
// row_end[i]) (col_end[-1] = 0; a member without a term has row_begin == row_end)
struct LoraSegs {
  int n;
  int col_end[kLoraMaxSegs];
  int row_begin[kLoraMaxSegs];
  int row_end[kLoraMaxSegs];
};

// block (s, t): rows [16 t, 16 t + 16) of a over the K chunk [s * U * 256, (s + 1) * U * 256); the last block of a
// row tile to finish (ticket) adds the tile's partials in chunk order and writes h
template <int MT, int U>
__global__ void __launch_bounds__(kShrinkWarps * 32) lora_shrink_kernel(const bf16* __restrict__ x,
                                                                        const bf16* __restrict__ a,
                                                                        float* __restrict__ part,
                                                                        float* __restrict__ h, int* counters,
                                                                        int M, int K, int R, int S) {
  constexpr int CH = U * kShrinkStep;
  __shared__ __align__(16) bf16 xs[MT][CH];
  __shared__ int s_last;
  qerl_pdl::trigger();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = blockIdx.x, tile = blockIdx.y;
  const int r0 = tile * kShrinkRows + warp * kShrinkRowsPerWarp;
  const int k0 = s * CH;
  Vec8 zero;
#pragma unroll
  for (int j = 0; j < 8; ++j) zero.v[j] = b(0.f);
  Vec8 av[kShrinkRowsPerWarp][U];  // the factor's slice: a constant, loaded before the wait
#pragma unroll
  for (int i = 0; i < kShrinkRowsPerWarp; ++i)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = k0 + u * kShrinkStep + 8 * lane;
      av[i][u] = (k < K && r0 + i < R) ? ld8(a + (size_t)(r0 + i) * K + k) : zero;
    }
  qerl_pdl::wait();
  {  // the activations' chunk into shared memory, every load in flight at once (zeros past K)
    constexpr int PER = MT * (CH / 8) / (kShrinkWarps * 32);
    Vec8 xv[PER];
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      const int idx = p * kShrinkWarps * 32 + tid, m = idx / (CH / 8), k = k0 + 8 * (idx % (CH / 8));
      xv[p] = (m < M && k < K) ? ld8(x + (size_t)m * K + k) : zero;
    }
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      const int idx = p * kShrinkWarps * 32 + tid;
      st8(&xs[idx / (CH / 8)][8 * (idx % (CH / 8))], xv[p]);
    }
  }
  __syncthreads();
  float acc[kShrinkRowsPerWarp][MT];
#pragma unroll
  for (int i = 0; i < kShrinkRowsPerWarp; ++i)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[i][m] = 0.f;
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m >= M) break;
      const Vec8 xv = ld8(&xs[m][u * kShrinkStep + 8 * lane]);
#pragma unroll
      for (int i = 0; i < kShrinkRowsPerWarp; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][m] += f(av[i][u].v[j]) * f(xv.v[j]);
    }
#pragma unroll
  for (int i = 0; i < kShrinkRowsPerWarp; ++i)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m >= M) break;
      float v = acc[i][m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == (m & 31) && r0 + i < R) part[((size_t)s * M + m) * R + r0 + i] = v;
    }
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&counters[tile], 1) == S - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  const int m = tid / kShrinkRows, r = tile * kShrinkRows + tid % kShrinkRows;  // 256 threads: M <= 16 rows
  if (m < M && r < R) {
    const float* p0 = part + (size_t)m * R + r;
    const size_t stride = (size_t)M * R;
    float sum = 0.f;
    for (int s0 = 0; s0 < S; s0 += 16) {  // sixteen loads in flight, added in chunk order
      float v[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) v[j] = s0 + j < S ? __ldcg(p0 + (size_t)(s0 + j) * stride) : 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j)
        if (s0 + j < S) sum += v[j];
    }
    h[(size_t)m * R + r] = f(b(sum));
  }
  if (tid == 0) counters[tile] = 0;  // ready for the next launch on this stream
}

// four threads per output column pair n, n + 1 (one member's: segment boundaries are even): thread q adds rows
// rb + q, rb + q + 4, ... of the member, then the four sums meet in two shuffles (the same fixed order for all
// four) and thread q writes the output rows m with m % 4 == q. h sits in shared memory transposed, [R][MT]
// (zeros past M), so one 16-byte load serves four output rows.
template <int MT>
__global__ void __launch_bounds__(kExpandThreads) lora_expand_kernel(const float* __restrict__ h,
                                                                     const bf16* __restrict__ y,
                                                                     const bf16* __restrict__ bs,
                                                                     bf16* __restrict__ out, int M, int N, int R,
                                                                     LoraSegs segs) {
  qerl_pdl::trigger();
  extern __shared__ float4 hs4[];  // [R][MT / 4]
  float* hs = reinterpret_cast<float*>(hs4);
  const int tid = threadIdx.x, q = tid % kExpandQ;
  const int n = (blockIdx.x * (kExpandThreads / kExpandQ) + tid / kExpandQ) * 2;
  int rb = 0, re = 0;
  bool found = n >= N;
#pragma unroll
  for (int i = 0; i < kLoraMaxSegs; ++i)  // (unrolled: the parameter arrays stay out of local memory)
    if (!found && i < segs.n && n < segs.col_end[i]) {
      rb = segs.row_begin[i];
      re = segs.row_end[i];
      found = true;
    }
  rb += q;  // this thread's rows: rb, rb + 4, ... below re
  __nv_bfloat162 bv[kExpandBatch];  // the first batch of them: a constant, loaded before the wait
#pragma unroll
  for (int j = 0; j < kExpandBatch; ++j)
    if (rb + kExpandQ * j < re) bv[j] = *reinterpret_cast<const __nv_bfloat162*>(bs + (size_t)(rb + kExpandQ * j) * N + n);
  qerl_pdl::wait();
  const int total = R * MT;
  for (int i0 = tid; i0 < total; i0 += 8 * kExpandThreads) {  // h [M][R] -> hs [R][MT], eight loads in flight
    float v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = i0 + j * kExpandThreads, r = i / MT, m = i % MT;
      v[j] = (i < total && m < M) ? __ldcg(h + (size_t)m * R + r) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (i0 + j * kExpandThreads < total) hs[i0 + j * kExpandThreads] = v[j];
  }
  __nv_bfloat162 yv[MT / kExpandQ];  // the output rows this thread writes: m = q + 4 w
#pragma unroll
  for (int w = 0; w < MT / kExpandQ; ++w) {
    const int m = q + kExpandQ * w;
    if (m < M && n < N) yv[w] = *reinterpret_cast<const __nv_bfloat162*>(y + (size_t)m * N + n);
  }
  __syncthreads();
  float acc[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
  for (int r0 = rb; r0 < re; r0 += kExpandQ * kExpandBatch) {
    if (r0 > rb) {
#pragma unroll
      for (int j = 0; j < kExpandBatch; ++j)
        if (r0 + kExpandQ * j < re)
          bv[j] = *reinterpret_cast<const __nv_bfloat162*>(bs + (size_t)(r0 + kExpandQ * j) * N + n);
    }
#pragma unroll
    for (int j = 0; j < kExpandBatch; ++j) {
      const int r = r0 + kExpandQ * j;
      if (r < re) {
        const float b0 = __low2float(bv[j]), b1 = __high2float(bv[j]);
#pragma unroll
        for (int c = 0; c < MT / 4; ++c) {
          const float4 hv = hs4[r * (MT / 4) + c];
          acc[4 * c][0] += hv.x * b0;
          acc[4 * c][1] += hv.x * b1;
          acc[4 * c + 1][0] += hv.y * b0;
          acc[4 * c + 1][1] += hv.y * b1;
          acc[4 * c + 2][0] += hv.z * b0;
          acc[4 * c + 2][1] += hv.z * b1;
          acc[4 * c + 3][0] += hv.w * b0;
          acc[4 * c + 3][1] += hv.w * b1;
        }
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      acc[m][c] += __shfl_xor_sync(0xffffffffu, acc[m][c], 1);
      acc[m][c] += __shfl_xor_sync(0xffffffffu, acc[m][c], 2);
    }
  if (n >= N) return;
#pragma unroll
  for (int w = 0; w < MT / kExpandQ; ++w) {
    const int m = q + kExpandQ * w;
    if (m < M)
      *reinterpret_cast<__nv_bfloat162*>(out + (size_t)m * N + n) =
          __floats2bfloat162_rn(__low2float(yv[w]) + acc[m][0], __high2float(yv[w]) + acc[m][1]);
  }
}

// rotary of 8 columns of a head, x * cos + rotate_half(x) * sin with torch's bf16 roundings: partner holds the
// columns D/2 away (rotate_half pairs column i with i + D/2), hi: these are the second half's columns
__device__ __forceinline__ Vec8 rope_half(const Vec8& x, const Vec8& partner, const Vec8& c, const Vec8& s, bool hi) {
  Vec8 o;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    // rotate_half(x) = cat(-x[half:], x[:half])
    const float ps = hi ? f(partner.v[j]) * f(s.v[j]) : -f(partner.v[j]) * f(s.v[j]);
    o.v[j] = b(f(b(f(x.v[j]) * f(c.v[j]))) + f(b(ps)));
  }
  return o;
}

// thread = (row, head, 8-wide chunk of the first half of head_dim): it writes that chunk and its partner in the
// second half (rotate_half pairs element i with i + D/2)
__global__ void rope_kv_kernel(const bf16* __restrict__ y, int64_t y_stride, const bf16* __restrict__ cos,
                               const bf16* __restrict__ sin, int64_t cs_stride, bf16* __restrict__ q_out,
                               bf16* __restrict__ kc, bf16* __restrict__ vc, const int64_t* __restrict__ slot0,
                               int batch, int t_len, int n_heads, int n_kv, int head_dim, int64_t slots) {
  qerl_pdl::trigger();
  qerl_pdl::wait();
  const int half = head_dim / 2, chunks = half / 8, heads = n_heads + 2 * n_kv;
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= static_cast<int64_t>(batch) * t_len * heads * chunks) return;
  const int c = static_cast<int>(idx % chunks);
  const int hd = static_cast<int>((idx / chunks) % heads);
  const int64_t r = idx / (static_cast<int64_t>(chunks) * heads);  // row = b * t_len + t
  const int bi = static_cast<int>(r / t_len), t = static_cast<int>(r % t_len);
  const int lo = c * 8, hi = lo + half;
  const bf16* x = y + r * y_stride + static_cast<int64_t>(hd) * head_dim;
  const Vec8 xl = ld8(x + lo), xh = ld8(x + hi);
  bf16* dst;
  if (hd < n_heads) {
    dst = q_out + ((static_cast<int64_t>(bi) * n_heads + hd) * t_len + t) * head_dim;
  } else {
    const int64_t s = *slot0 + t;
    if (s < 0 || s >= slots) return;  // the wrapper's caller guarantees the slot; never write outside the cache
    const int kv = hd < n_heads + n_kv ? hd - n_heads : hd - n_heads - n_kv;
    dst = (hd < n_heads + n_kv ? kc : vc) + ((static_cast<int64_t>(bi) * n_kv + kv) * slots + s) * head_dim;
    if (hd >= n_heads + n_kv) {  // v: copied as it is
      st8(dst + lo, xl);
      st8(dst + hi, xh);
      return;
    }
  }
  const bf16* cr = cos + r * cs_stride;
  const bf16* sr = sin + r * cs_stride;
  st8(dst + lo, rope_half(xl, xh, ld8(cr + lo), ld8(sr + lo), false));
  st8(dst + hi, rope_half(xh, xl, ld8(cr + hi), ld8(sr + hi), true));
}

#include "decode_attn.cuh"

// ---------------------------------------------------------------------------------------------------------
// One decode step's sampling from fp32 logits [rows, V] at temperature T without truncation (no top-k / top-p),
// with the step's bookkeeping, in one kernel instead of about fifteen torch ops:
//   * token: the Gumbel-max trick, tok = argmax_i (z_i + G_i) with z = logits / T and G_i = -log(-log(U_i)), an
//     exact draw from softmax(z); U_i from Philox4x32-10 keyed by the seed, counter (i / 4, step, row, 0), so a
//     draw depends on (seed, step, row) only, not on the launch's split;
//   * log-prob: z_tok - logsumexp(z) (the behaviour log-prob: tempered, nothing truncated), fp32;
//   * finished rows (an earlier eos) get the pad token, mask 0 and log-prob 0; a live row that samples an eos
//     becomes finished; a row whose logits hold a NaN or +inf raises the flag *bad (nothing is sampled from it).
// Block (row, s) scans slice s of the vocabulary (online max / sum of exponentials, Gumbel argmax), writes its
// partial to the workspace, and the last block of the row (a self-resetting ticket) combines the partials in
// slice order (ties: the lower index), so the result does not depend on scheduling.
constexpr int kSampleThreads = 256;
constexpr int kSampleMaxSplit = 64;
constexpr int kSampleMaxRows = 16384;

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int i = 0; i < 10; ++i) {
    const uint32_t hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    k.x += 0x9E3779B9u;
    k.y += 0xBB67AE85u;
  }
  return c;
}

// a uniform in (0, 1) from 32 random bits (never 0 or 1: the Gumbel transform stays finite)
__device__ __forceinline__ float unit_open(uint32_t r) { return (static_cast<float>(r >> 8) + 0.5f) * 0x1p-24f; }

struct SamplePart {
  float m, l, g;  // running max of z, sum of exp(z - m), best z + G
  int i;          // its index
};

__device__ __forceinline__ void part_add(SamplePart& a, const SamplePart& b) {
  if (b.m != -INFINITY) {
    if (a.m == -INFINITY) {
      a.m = b.m;
      a.l = b.l;
    } else if (b.m > a.m) {
      a.l = a.l * __expf(a.m - b.m) + b.l;
      a.m = b.m;
    } else {
      a.l += b.l * __expf(b.m - a.m);
    }
  }
  if (b.g > a.g || (b.g == a.g && b.i < a.i)) {
    a.g = b.g;
    a.i = b.i;
  }
}

__global__ void __launch_bounds__(kSampleThreads) sample_step_kernel(
    const float* __restrict__ logits, int64_t ld, int V, float inv_t, uint2 key, uint32_t step, int chunk,
    float4* __restrict__ ws, int* __restrict__ counters, bool* __restrict__ finished, const int64_t* __restrict__ eos,
    int n_eos, int64_t pad, int64_t* __restrict__ tok_out, int64_t* __restrict__ out, bool* __restrict__ mask,
    float* __restrict__ blp, float* __restrict__ tlp, int64_t col_ld, int* __restrict__ bad) {
  qerl_pdl::trigger();
  qerl_pdl::wait();
  const int row = blockIdx.x, s = blockIdx.y, S = gridDim.y;
  const float* z = logits + (int64_t)row * ld;
  const int lo = s * chunk, hi = min(V, lo + chunk);  // chunk % 4 == 0: a Philox block never straddles slices
  SamplePart p{-INFINITY, 0.f, -INFINITY, INT_MAX};
  bool nonfinite = false;
  for (int q = lo + 4 * threadIdx.x; q < hi; q += 4 * kSampleThreads) {
    const uint4 r = philox4x32_10(make_uint4(static_cast<uint32_t>(q >> 2), step, static_cast<uint32_t>(row), 0u), key);
    const uint32_t rr[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = q + j;
      if (i >= hi) break;
      const float v = z[i];
      if (v != v || v == INFINITY) nonfinite = true;
      const float zz = v * inv_t;
      if (!(zz > -INFINITY)) continue;  // a masked token (or NaN, flagged): never drawn, adds nothing
      if (zz > p.m) {
        p.l = (p.m == -INFINITY ? 0.f : p.l * __expf(p.m - zz)) + 1.f;
        p.m = zz;
      } else {
        p.l += __expf(zz - p.m);
      }
      const float gv = zz - logf(-logf(unit_open(rr[j])));
      if (gv > p.g) {  // (indices rise within a thread: ties keep the lower)
        p.g = gv;
        p.i = i;
      }
    }
  }
  // the block's partial: lanes, then warps in order
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    SamplePart b{__shfl_xor_sync(0xffffffffu, p.m, o), __shfl_xor_sync(0xffffffffu, p.l, o),
                 __shfl_xor_sync(0xffffffffu, p.g, o), __shfl_xor_sync(0xffffffffu, p.i, o)};
    part_add(p, b);
  }
  __shared__ SamplePart wp[kSampleThreads / 32];
  __shared__ int s_last, s_bad;
  if (threadIdx.x == 0) s_bad = 0;
  __syncthreads();
  if (nonfinite) s_bad = 1;
  if ((threadIdx.x & 31) == 0) wp[threadIdx.x >> 5] = p;
  __syncthreads();
  if (threadIdx.x == 0) {
    SamplePart t = wp[0];
    for (int w = 1; w < kSampleThreads / 32; ++w) part_add(t, wp[w]);
    ws[(int64_t)row * S + s] = make_float4(t.m, t.l, t.g, __int_as_float(t.i));
    if (s_bad) atomicOr(bad, 1);
    __threadfence();
    s_last = atomicAdd(&counters[row], 1) == S - 1;
  }
  __syncthreads();
  if (!s_last || threadIdx.x >= 32) return;
  // the last block's first warp: lane j takes partials j, j + 32 (S <= 64, both loads in flight), then a fixed
  // shuffle tree (the same order at every launch)
  __threadfence();
  const int lane = threadIdx.x;
  SamplePart t{-INFINITY, 0.f, -INFINITY, INT_MAX};
  {
    const float4 w0 = lane < S ? __ldcg(ws + (int64_t)row * S + lane) : make_float4(-INFINITY, 0.f, -INFINITY, 0.f);
    const float4 w1 = lane + 32 < S ? __ldcg(ws + (int64_t)row * S + lane + 32)
                                    : make_float4(-INFINITY, 0.f, -INFINITY, 0.f);
    if (lane < S) part_add(t, SamplePart{w0.x, w0.y, w0.z, __float_as_int(w0.w)});
    if (lane + 32 < S) part_add(t, SamplePart{w1.x, w1.y, w1.z, __float_as_int(w1.w)});
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    SamplePart b{__shfl_xor_sync(0xffffffffu, t.m, o), __shfl_xor_sync(0xffffffffu, t.l, o),
                 __shfl_xor_sync(0xffffffffu, t.g, o), __shfl_xor_sync(0xffffffffu, t.i, o)};
    part_add(t, b);
  }
  if (lane != 0) return;
  counters[row] = 0;  // ready for the next launch on this stream
  const bool live = !finished[row];
  const bool ok = t.i != INT_MAX;  // (a row of -inf / NaN only: flagged through *bad when NaN)
  const int64_t tok = live && ok ? static_cast<int64_t>(t.i) : pad;
  const float lp = live && ok ? z[t.i] * inv_t - (t.m + logf(t.l)) : 0.f;
  tok_out[row] = tok;
  out[(int64_t)row * col_ld] = tok;
  mask[(int64_t)row * col_ld] = live;
  blp[(int64_t)row * col_ld] = lp;
  tlp[(int64_t)row * col_ld] = lp;
  if (live) {
    bool hit = false;
    for (int e = 0; e < n_eos; ++e) hit |= eos[e] == tok;
    if (hit) finished[row] = true;
  }
}

#ifndef QERL_NO_TORCH

namespace {

const bf16* cptr(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
bf16* mptr(const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

void check_bf16(const at::Tensor& t, const char* name) {
  QERL_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16, "qerl_fused: %s must be a CUDA bf16 tensor", name);
  QERL_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "qerl_fused: %s must be 16-byte aligned", name);
}

int blocks_for(int64_t threads, int per_block) { return static_cast<int>((threads + per_block - 1) / per_block); }

}  // namespace

// h, d: [rows, width] contiguous (d may be undefined: norm only); w: [width] or [groups, width] with
// rows = groups * rows_per_w; writes h_out = h + d (when d is given) and x_out = rmsnorm(h_out) * w; with a
// [R, width] (contiguous bf16) also hs [rows, R] (fp32) = bf16(x_out @ a^T), a LoRA shrink (see kNormShrinkRB)
void add_rmsnorm(const at::Tensor& h, const c10::optional<at::Tensor>& d, const at::Tensor& w, int64_t rows_per_w,
                 at::Tensor& h_out, at::Tensor& x_out, double eps, const c10::optional<at::Tensor>& a,
                 const c10::optional<at::Tensor>& hs) {
  check_bf16(h, "h");
  const bool w32 = w.scalar_type() == at::kFloat;
  if (w32) {
    QERL_CHECK(w.is_cuda() && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
               "qerl_fused: w must be a 16-byte aligned CUDA tensor");
  } else {
    check_bf16(w, "w");
  }
  check_bf16(x_out, "x_out");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && x_out.sizes() == h.sizes() && x_out.is_contiguous(),
              "qerl_fused: add_rmsnorm needs contiguous [rows, width] h and x_out");
  const int64_t rows = h.size(0), width = h.size(1);
  QERL_CHECK(width % 8 == 0 && width <= 8 * kNormChunks * kNormThreads,
             "qerl_fused: width %lld must be a multiple of 8 and at most %d", (long long)width,
             8 * kNormChunks * kNormThreads);
  TORCH_CHECK(w.is_contiguous() && w.size(-1) == width && rows_per_w > 0 &&
                  (w.dim() == 1 || (w.dim() == 2 && w.size(0) * rows_per_w == rows)),
              "qerl_fused: w must be [width] or [rows / rows_per_w, width]");
  const bf16* dp = nullptr;
  if (d.has_value()) {
    check_bf16(*d, "d");
    check_bf16(h_out, "h_out");
    TORCH_CHECK(d->sizes() == h.sizes() && d->is_contiguous() && h_out.sizes() == h.sizes() && h_out.is_contiguous(),
                "qerl_fused: d and h_out must be contiguous and shaped like h");
    dp = cptr(*d);
  }
  const bf16* ap = nullptr;
  float* hsp = nullptr;
  int64_t R = 0;
  if (a.has_value()) {
    check_bf16(*a, "a");
    TORCH_CHECK(hs.has_value() && a->dim() == 2 && a->is_contiguous() && a->size(1) == width && a->size(0) > 0,
                "qerl_fused: add_rmsnorm's a must be contiguous [R, width], with hs");
    R = a->size(0);
    TORCH_CHECK(hs->is_cuda() && hs->scalar_type() == at::kFloat && hs->is_contiguous() && hs->dim() == 2 &&
                    hs->size(0) == rows && hs->size(1) == R,
                "qerl_fused: add_rmsnorm's hs must be a contiguous fp32 [rows, R] CUDA tensor");
    ap = cptr(*a);
    hsp = hs->data_ptr<float>();
  }
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(h.device());
  const int64_t w_stride = w.dim() == 1 ? int64_t(0) : width;
  const int w_rows = static_cast<int>(w.dim() == 1 ? rows : rows_per_w);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(ap ? (R + kNormShrinkRB - 1) / kNormShrinkRB : 1));
  const size_t smem = ap ? (size_t)kNormShrinkRB * width * sizeof(bf16) : 0;  // <= 64 KB
  if (smem > 48 * 1024) {  // (once per device and kernel; idempotent, so a race between threads is harmless)
    C10_CUDA_CHECK(cudaFuncSetAttribute(add_rmsnorm_kernel<float>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
    C10_CUDA_CHECK(cudaFuncSetAttribute(add_rmsnorm_kernel<bf16>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
  }
  if (w32) {
    C10_CUDA_CHECK(qerl_pdl::launch(add_rmsnorm_kernel<float>, grid, dim3(kNormThreads), smem, stream, h.get_device(),
                                     cptr(h), dp, reinterpret_cast<const float*>(w.data_ptr()), w_stride, w_rows,
                                     dp ? mptr(h_out) : nullptr, mptr(x_out), static_cast<int>(width),
                                     static_cast<float>(eps), ap, static_cast<int>(R), hsp));
  } else {
    C10_CUDA_CHECK(qerl_pdl::launch(add_rmsnorm_kernel<bf16>, grid, dim3(kNormThreads), smem, stream, h.get_device(),
                                     cptr(h), dp, cptr(w), w_stride, w_rows, dp ? mptr(h_out) : nullptr, mptr(x_out),
                                     static_cast<int>(width), static_cast<float>(eps), ap, static_cast<int>(R), hsp));
  }
}

// g, u: [rows, width] views with unit column stride and one shared row stride; out: [rows, width] contiguous;
// with a [R, width] (contiguous bf16) also hs [rows, R] (fp32) = bf16(out @ a^T), the down projection's LoRA shrink
void silu_mul(const at::Tensor& g, const at::Tensor& u, at::Tensor& out, const c10::optional<at::Tensor>& a,
              const c10::optional<at::Tensor>& hs) {
  check_bf16(g, "g");
  check_bf16(u, "u");
  check_bf16(out, "out");
  TORCH_CHECK(g.dim() == 2 && u.sizes() == g.sizes() && out.sizes() == g.sizes() && out.is_contiguous(),
              "qerl_fused: silu_mul needs g, u, out of one [rows, width] shape, out contiguous");
  TORCH_CHECK(g.stride(1) == 1 && u.stride(1) == 1 && g.stride(0) == u.stride(0) && g.stride(0) % 8 == 0 &&
                  g.size(1) % 8 == 0,
              "qerl_fused: silu_mul needs unit column strides, one row stride, widths and strides multiple of 8");
  const int64_t rows = g.size(0), width = g.size(1), n = rows * (width / 8);
  if (a.has_value()) {
    check_bf16(*a, "a");
    TORCH_CHECK(hs.has_value() && a->dim() == 2 && a->is_contiguous() && a->size(1) == width && a->size(0) > 0 &&
                    width < (int64_t(1) << 30),
                "qerl_fused: silu_mul's a must be contiguous [R, width], with hs");
    const int64_t R = a->size(0);
    TORCH_CHECK(hs->is_cuda() && hs->scalar_type() == at::kFloat && hs->is_contiguous() && hs->dim() == 2 &&
                    hs->size(0) == rows && hs->size(1) == R,
                "qerl_fused: silu_mul's hs must be a contiguous fp32 [rows, R] CUDA tensor");
    if (rows == 0) return;
    const c10::cuda::CUDAGuard guard(g.device());
    const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>((R + kSiluShrinkRB - 1) / kSiluShrinkRB));
    C10_CUDA_CHECK(qerl_pdl::launch(silu_mul_shrink_kernel, grid, dim3(kNormThreads), 0,
                                     c10::cuda::getCurrentCUDAStream().stream(), g.get_device(), cptr(g), cptr(u),
                                     g.stride(0), mptr(out), static_cast<int>(width), cptr(*a), static_cast<int>(R),
                                     hs->data_ptr<float>()));
    return;
  }
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(g.device());
  C10_CUDA_CHECK(qerl_pdl::launch(silu_mul_kernel, dim3(blocks_for(n, 256)), dim3(256), 0,
                                   c10::cuda::getCurrentCUDAStream().stream(), g.get_device(), cptr(g), cptr(u),
                                   g.stride(0), mptr(out), rows, static_cast<int>(width)));
}

// y: [B * T, (H + 2 KV) * D] rows (unit column stride); cos, sin: [B * T, D] rows; q_out [B, H, T, D]
// contiguous; kc, vc [B, KV, S, D] contiguous; slot0: int64 scalar on the device (first slot of this call)
void rope_kv(const at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q_out, at::Tensor& kc,
             at::Tensor& vc, const at::Tensor& slot0, int64_t t_len) {
  check_bf16(y, "y");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  check_bf16(q_out, "q_out");
  check_bf16(kc, "kc");
  check_bf16(vc, "vc");
  TORCH_CHECK(q_out.dim() == 4 && kc.dim() == 4 && kc.sizes() == vc.sizes() && q_out.is_contiguous() &&
                  kc.is_contiguous() && vc.is_contiguous(),
              "qerl_fused: rope_kv needs contiguous q_out [B, H, T, D] and caches [B, KV, S, D]");
  const int64_t batch = q_out.size(0), n_heads = q_out.size(1), d = q_out.size(3), n_kv = kc.size(1);
  TORCH_CHECK(q_out.size(2) == t_len && kc.size(0) == batch && kc.size(3) == d && d % 16 == 0,
              "qerl_fused: rope_kv shapes disagree (head_dim must be a multiple of 16)");
  TORCH_CHECK(y.dim() == 2 && y.size(0) == batch * t_len && y.size(1) == (n_heads + 2 * n_kv) * d &&
                  y.stride(1) == 1 && y.stride(0) % 8 == 0,
              "qerl_fused: rope_kv needs y [B * T, (H + 2 KV) * D] with unit column stride");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == batch * t_len && cos.size(1) == d &&
                  cos.stride(1) == 1 && sin.stride(1) == 1 && cos.stride(0) == sin.stride(0) && cos.stride(0) % 8 == 0,
              "qerl_fused: rope_kv needs cos, sin [B * T, D] with one row stride");
  TORCH_CHECK(slot0.is_cuda() && slot0.scalar_type() == at::kLong && slot0.numel() == 1,
              "qerl_fused: slot0 must be one int64 on the device");
  const int64_t n = batch * t_len * (n_heads + 2 * n_kv) * (d / 16);
  if (n == 0) return;
  const c10::cuda::CUDAGuard guard(y.device());
  C10_CUDA_CHECK(qerl_pdl::launch(rope_kv_kernel, dim3(blocks_for(n, 128)), dim3(128), 0,
                                   c10::cuda::getCurrentCUDAStream().stream(), y.get_device(), cptr(y), y.stride(0),
                                   cptr(cos), cptr(sin), cos.stride(0), mptr(q_out), mptr(kc), mptr(vc),
                                   static_cast<const int64_t*>(slot0.data_ptr<int64_t>()), static_cast<int>(batch),
                                   static_cast<int>(t_len), static_cast<int>(n_heads), static_cast<int>(n_kv),
                                   static_cast<int>(d), kc.size(2)));
}

// The self-resetting tickets of lora_shrink_kernel and decode_attn_kernel: __device__ arrays, zero from the module's
// load on each device, and every launch leaves them zero. (Not tensors allocated on first use: a first use inside
// a CUDA-graph capture would take them from the graph's pool and zero them only when that graph is replayed;
// a graph captured but never replayed, a rollout of one token, left the next graph's tickets unset.) One set
// per device: launches that share tickets must not run concurrently, which holds for one stream's launches and
// graph replays (the engine's).
__device__ int g_shrink_tickets[kShrinkMaxTiles] = {};
__device__ int g_attn_tickets[kAttnMaxPairs] = {};

template <typename T>
int* device_tickets(const T& symbol, int dev, int* (&cache)[64]) {
  if (dev >= 0 && dev < 64 && cache[dev]) return cache[dev];
  void* p = nullptr;
  C10_CUDA_CHECK(cudaGetSymbolAddress(&p, symbol));  // (the caller's device guard selects the device)
  if (dev >= 0 && dev < 64) cache[dev] = static_cast<int*>(p);  // (benign race: every writer stores the same value)
  return static_cast<int*>(p);
}

int* lora_counters(const at::Tensor& like) {
  static int* cache[64] = {nullptr};
  return device_tickets(g_shrink_tickets, like.get_device(), cache);
}

// segs (see lora_add) into LoraSegs; false when they are malformed (odd, decreasing, past R or not ending at N)
bool parse_segs(const std::vector<int64_t>& segs, int64_t N, int64_t R, LoraSegs& sg) {
  sg = LoraSegs{};
  if (segs.empty()) {
    sg.n = 1;
    sg.col_end[0] = static_cast<int>(N);
    sg.row_end[0] = static_cast<int>(R);
    return true;
  }
  if (segs.size() % 3 != 0 || segs.size() / 3 > (size_t)kLoraMaxSegs) return false;
  sg.n = static_cast<int>(segs.size() / 3);
  int64_t prev = 0;
  for (int i = 0; i < sg.n; ++i) {
    const int64_t ce = segs[3 * i], rb = segs[3 * i + 1], re = segs[3 * i + 2];
    if (ce <= prev || ce % 2 != 0 || rb < 0 || rb > re || re > R) return false;
    sg.col_end[i] = static_cast<int>(ce);
    sg.row_begin[i] = static_cast<int>(rb);
    sg.row_end[i] = static_cast<int>(re);
    prev = ce;
  }
  return prev == N;
}

// the shrink kernel alone: h [M, R] (fp32 holding bf16 values) = bf16(x @ a^T); its partials in a scratch tensor
template <int MT, int U>
void launch_shrink(const at::Tensor& x, const at::Tensor& a, float* hp) {
  const int M = static_cast<int>(x.size(0)), K = static_cast<int>(x.size(1)), R = static_cast<int>(a.size(0));
  const int S = (K + U * kShrinkStep - 1) / (U * kShrinkStep), tiles = (R + kShrinkRows - 1) / kShrinkRows;
  at::Tensor part = at::empty({(int64_t)S * M * R}, x.options().dtype(at::kFloat));
  C10_CUDA_CHECK(qerl_pdl::launch(lora_shrink_kernel<MT, U>, dim3(S, tiles), dim3(kShrinkWarps * 32), 0,
                                   c10::cuda::getCurrentCUDAStream().stream(), x.get_device(), cptr(x), cptr(a),
                                   part.data_ptr<float>(), hp, lora_counters(x), M, K, R, S));
}

// by M (8 or 16 rows per kernel) and K (longer K chunks past 8192: fewer partials to gather)
void launch_shrink_for(const at::Tensor& x, const at::Tensor& a, float* hp) {
  const bool wide = x.size(1) > 8192;
  if (x.size(0) <= 8) {
    if (wide) launch_shrink<8, 4>(x, a, hp);
    else launch_shrink<8, 2>(x, a, hp);
  } else {
    if (wide) launch_shrink<16, 4>(x, a, hp);
    else launch_shrink<16, 2>(x, a, hp);
  }
}

// the expand kernel: out = y + hs @ bs (hs [M, R] fp32, M <= 16)
void launch_expand(const at::Tensor& hs, const at::Tensor& y, const at::Tensor& bs, at::Tensor& out,
                   const LoraSegs& sg) {
  const int M = static_cast<int>(hs.size(0)), R = static_cast<int>(hs.size(1)), N = static_cast<int>(y.size(1));
  const int MT = M <= 8 ? 8 : 16;
  auto launch = [&](auto kern) {
    C10_CUDA_CHECK(qerl_pdl::launch(kern, dim3(blocks_for(N / 2, kExpandThreads / kExpandQ)), dim3(kExpandThreads),
                                     (size_t)R * MT * sizeof(float), c10::cuda::getCurrentCUDAStream().stream(),
                                     y.get_device(), hs.data_ptr<float>(), cptr(y), cptr(bs), mptr(out), M, N, R,
                                     sg));
  };
  if (MT == 8) launch(lora_expand_kernel<8>);
  else launch(lora_expand_kernel<16>);
}

// out [M, N] = y + bf16(x @ a^T) @ bs for M <= 16 decode rows (see lora_shrink_kernel): x [M, K], a [R, K],
// y / out [M, N], bs [R, N], all contiguous bf16; K % 8 == 0, N % 2 == 0, R <= 1024 (M <= 8) or 512. segs: flat
// (col_end, row_begin, row_end) triples, at most 8, col_end increasing, even and ending at N: columns up to
// col_end read only rows [row_begin, row_end) of bs (its other rows there must be zero); empty: every row.
// Returns false (nothing launched) when the tensors are outside what the kernels take: the caller then uses its
// matmuls.
bool lora_add(const at::Tensor& x, const at::Tensor& a, const at::Tensor& y, const at::Tensor& bs, at::Tensor& out,
              const std::vector<int64_t>& segs) {
  const at::Tensor* args[] = {&x, &a, &y, &bs, &out};
  for (const at::Tensor* t : args) {
    if (!t->is_cuda() || t->scalar_type() != at::kBFloat16 || !t->is_contiguous() || t->dim() != 2 ||
        reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0 || t->get_device() != x.get_device())
      return false;
  }
  const int64_t M = x.size(0), K = x.size(1), R = a.size(0), N = y.size(1);
  // (fused.lora_add raises on disagreeing shapes before calling; here they only decline)
  if (a.size(1) != K || y.size(0) != M || bs.size(0) != R || bs.size(1) != N || out.sizes() != y.sizes()) return false;
  if (M < 1 || M > kLoraMaxM || R < 1 || R > kShrinkRows * kShrinkMaxTiles || K % 8 != 0 || K >= (1 << 30) ||
      N % 2 != 0 || N >= (1 << 30) || R * (M <= 8 ? 8 : 16) > 8192)  // (h transposed in 32 KB of shared memory)
    return false;
  LoraSegs sg{};
  if (!parse_segs(segs, N, R, sg)) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor hs = at::empty({M, R}, x.options().dtype(at::kFloat));
  launch_shrink_for(x, a, hs.data_ptr<float>());
  launch_expand(hs, y, bs, out, sg);
  return true;
}

// hs [M, R] = bf16(x @ a^T) as fp32 (the shrink of lora_add alone, for the NVFP4 kernel's LoRA term): x [M, K],
// a [R, K] contiguous bf16 as in lora_add, hs contiguous fp32. False (nothing launched) where the kernel does not
// take the tensors.
bool lora_shrink(const at::Tensor& x, const at::Tensor& a, at::Tensor& hs) {
  const at::Tensor* args[] = {&x, &a};
  for (const at::Tensor* t : args) {
    if (!t->is_cuda() || t->scalar_type() != at::kBFloat16 || !t->is_contiguous() || t->dim() != 2 ||
        reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0 || t->get_device() != x.get_device())
      return false;
  }
  const int64_t M = x.size(0), K = x.size(1), R = a.size(0);
  if (!hs.is_cuda() || hs.scalar_type() != at::kFloat || !hs.is_contiguous() || hs.dim() != 2 || hs.size(0) != M ||
      hs.size(1) != R || hs.get_device() != x.get_device() || a.size(1) != K)
    return false;
  if (M < 1 || M > kLoraMaxM || R < 1 || R > kShrinkRows * kShrinkMaxTiles || K % 8 != 0 || K >= (1 << 30))
    return false;
  const c10::cuda::CUDAGuard guard(x.device());
  launch_shrink_for(x, a, hs.data_ptr<float>());
  return true;
}

// out [M, N] = y + hs @ bs: the expand of lora_add alone, for an hs [M, R] (fp32 holding bf16 values, contiguous)
// that a fused shrink made (add_rmsnorm / silu_mul with a); y, out, bs as in lora_add. False (nothing launched)
// where the kernel does not take the tensors.
bool lora_expand(const at::Tensor& hs, const at::Tensor& y, const at::Tensor& bs, at::Tensor& out,
                 const std::vector<int64_t>& segs) {
  const at::Tensor* args[] = {&y, &bs, &out};
  for (const at::Tensor* t : args) {
    if (!t->is_cuda() || t->scalar_type() != at::kBFloat16 || !t->is_contiguous() || t->dim() != 2 ||
        reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0 || t->get_device() != y.get_device())
      return false;
  }
  if (!hs.is_cuda() || hs.scalar_type() != at::kFloat || !hs.is_contiguous() || hs.dim() != 2 ||
      hs.get_device() != y.get_device())
    return false;
  const int64_t M = hs.size(0), R = hs.size(1), N = y.size(1);
  if (y.size(0) != M || bs.size(0) != R || bs.size(1) != N || out.sizes() != y.sizes()) return false;
  if (M < 1 || M > kLoraMaxM || R < 1 || N % 2 != 0 || N >= (1 << 30) || R * (M <= 8 ? 8 : 16) > 8192) return false;
  LoraSegs sg{};
  if (!parse_segs(segs, N, R, sg)) return false;
  const c10::cuda::CUDAGuard guard(y.device());
  launch_expand(hs, y, bs, out, sg);
  return true;
}

int* attn_tickets(const at::Tensor& like) {
  static int* cache[64] = {nullptr};
  return device_tickets(g_attn_tickets, like.get_device(), cache);
}

int sm_count(int dev) {
  static int count[64] = {0};  // (benign race: every writer stores the same value)
  int sms = dev >= 0 && dev < 64 ? count[dev] : 0;
  if (sms == 0) {
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    if (dev >= 0 && dev < 64) count[dev] = sms;
  }
  return sms;
}

// decode_attn_kernel<D>'s shared-memory limit raised to its size, once per device (the size is fixed)
template <int D>
void attn_smem_limit(int dev) {
  static bool raised[64] = {false};
  if (dev >= 0 && dev < 64 && !raised[dev]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(decode_attn_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(AttnCfg<D>::kSmem)));
    raised[dev] = true;
  }
}

template <int D>
int attn_blocks_per_sm(int dev) {
  attn_smem_limit<D>(dev);
  int v = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, decode_attn_kernel<D>, kAttnThreads,
                                                               AttnCfg<D>::kSmem));
  return std::max(v, 1);
}

// the last decode_attn launch's splits, negative when they were added in a cluster (tests)
static int64_t g_attn_last = 0;
// decode_attn_kernel's PDL trigger: 0 at its start, 1 once a block's loads have landed (set_attn_late_trigger)
static int g_attn_late_trigger = 0;

// whether `pairs` clusters of `splits` blocks of decode_attn_kernel<D> are resident at once on device dev
// (session 18, H100: 64 clusters of 6 on the 32B heads at batch 8, 384 blocks of a 396-block wave, took 18.3 us
// against 13.9 through the workspace; the GPC boundaries leave fewer cluster places than blocks / splits)
template <int D>
bool attn_clusters_fit(int dev, int64_t pairs, int64_t splits, cudaStream_t stream) {
  static int fit[64][kAttnMaxCluster + 1] = {{0}};  // active clusters per size, 0: not asked yet
  int v = dev >= 0 && dev < 64 ? fit[dev][splits] : 0;
  if (v == 0) {
    attn_smem_limit<D>(dev);
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(static_cast<unsigned>(splits), 1, 1);
    cfg.blockDim = dim3(kAttnThreads);
    cfg.dynamicSmemBytes = AttnCfg<D>::kSmem;
    cfg.stream = stream;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = static_cast<unsigned>(splits);
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&v, decode_attn_kernel<D>, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // (this query's own error, not fatal: no cluster this call; asked again next time)
      return false;
    }
    if (v <= 0) v = -1;  // -1: none fit
    if (dev >= 0 && dev < 64) fit[dev][splits] = v;
  }
  return v > 0 && pairs <= v;
}

// blocks of decode_attn_kernel<D> resident at once on device dev (one wave): blocks per SM x SMs
int64_t attn_wave(int dev, int64_t D) {
  static int per_sm[64][2] = {{0}};  // (benign race: every writer stores the same value)
  const int which = D == 128 ? 1 : 0;
  int v = dev >= 0 && dev < 64 ? per_sm[dev][which] : 0;
  if (v == 0) {
    v = D == 128 ? attn_blocks_per_sm<128>(dev) : attn_blocks_per_sm<64>(dev);
    if (dev >= 0 && dev < 64) per_sm[dev][which] = v;
  }
  return static_cast<int64_t>(v) * sm_count(dev);
}

template <int D>
void launch_decode_attn(const bf16* q, int64_t B, int64_t H, at::Tensor& kc, at::Tensor& vc,
                        const at::Tensor& key_mask, const at::Tensor& slot, at::Tensor& out, int64_t splits,
                        double scale, bool cluster, const AttnRope& rope) {
  const int dev = kc.get_device();
  attn_smem_limit<D>(dev);
  const int64_t KV = kc.size(1), group = H / KV;
  at::Tensor ws = splits > 1 && !cluster ? at::empty({B * KV * splits * kAttnRecord}, kc.options().dtype(at::kFloat))
                                         : at::Tensor();
  C10_CUDA_CHECK(qerl_pdl::launch_cluster_dims(
      decode_attn_kernel<D>, dim3(static_cast<unsigned>(splits), static_cast<unsigned>(KV), static_cast<unsigned>(B)),
      dim3(kAttnThreads), AttnCfg<D>::kSmem, c10::cuda::getCurrentCUDAStream().stream(), dev,
      dim3(cluster ? static_cast<unsigned>(splits) : 1u, 1, 1), q, mptr(kc), mptr(vc),
      key_mask.data_ptr<bool>(), key_mask.stride(0), slot.data_ptr<int64_t>(), mptr(out),
      ws.defined() ? ws.data_ptr<float>() : nullptr, attn_tickets(kc), static_cast<int>(KV), static_cast<int>(group),
      kc.size(2), static_cast<float>(scale * 1.4426950408889634), cluster ? 1 : 0, g_attn_late_trigger, rope));
}

// out [B, H * D] (any shape of that many elements, contiguous bf16) = one decode step's attention (see
// csrc/decode_attn.cuh): q [B, H, 1, D] and the caches [B, KV, S, D] contiguous bf16, key_mask [B, >= S] bool with
// unit column stride, slot one int64 on the device (the step's slot: slots [0, slot] are attended). False
// (nothing launched) where the kernel does not take the tensors: D not 64 or 128, more than 8 query heads per KV
// head, more than 256 * (16384 / D) slots, more than 65,536 (row, KV head) pairs. splits_req > 0 asks for that many
// splits of the attended slots (at least the number that keeps a block's slots in its buffers, at most 256); 0
// lets the host choose: about two blocks per SM, at most 8 where the splits can run as a cluster. cluster_req: 1
// reduces 2 ... 8 splits in a thread-block cluster (sm_90), 0 through the workspace, -1 as QERL_ATTN_CLUSTER says
// (on unless it is 0); a cluster is taken only where all the blocks fit one wave (session 18, H100: with more
// blocks the clusters measured slower than the workspace, at batch 32 and 64 on the 7B heads, batch 8 on the 32B
// heads). one_wave_only: false (nothing launched) unless the blocks fit one wave, where the kernel measured
// faster than SDPA (with more, SDPA's flash kernel won or tied).
// a bf16 tensor on device dev, contiguous and 16-byte aligned (what decode_attn_kernel reads and writes)
static bool attn_bf16(const at::Tensor& t, int dev) {
  return t.is_cuda() && t.get_device() == dev && t.scalar_type() == at::kBFloat16 && t.is_contiguous() &&
         reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// QERL_ATTN_CLUSTER: decode_attn's clusters on unless it is 0 (read once)
static bool attn_cluster_env() {
  static const bool on = [] {
    const char* e = std::getenv("QERL_ATTN_CLUSTER");
    return !(e && e[0] == '0');
  }();
  return on;
}

// the splits of a decode_attn launch over `pairs` (row, KV head) pairs of S slots of head dim D on device dev
// (splits_req > 0: asked for; cluster_ok: splits may be added in a cluster); 0 where the slots need more than
// kAttnMaxSplits
static int64_t attn_splits(int dev, int64_t pairs, int64_t S, int64_t D, int64_t splits_req, bool cluster_ok) {
  const int64_t max_chunk = D == 128 ? AttnCfg<128>::kMaxChunk : AttnCfg<64>::kMaxChunk;
  const int64_t need = (S + max_chunk - 1) / max_chunk;  // splits that keep every block's slots in its buffers
  if (need > kAttnMaxSplits) return 0;
  // about two blocks per SM, at least 32 slots each; at most a cluster's worth where the buffers allow
  int64_t want = std::min<int64_t>((2 * sm_count(dev) + pairs - 1) / pairs, (S + 31) / 32);
  if (cluster_ok && need <= kAttnMaxCluster && pairs * kAttnMaxCluster <= attn_wave(dev, D))
    want = std::min<int64_t>(want, kAttnMaxCluster);
  return std::min<int64_t>(std::max<int64_t>({need, splits_req > 0 ? splits_req : want, int64_t(1)}), kAttnMaxSplits);
}

// whether decode_attn (splits and clusters chosen by the launcher, QERL_ATTN_CLUSTER as set) takes a step of B rows
// of H query heads over caches [B, KV, S, D] on device dev, by their shapes alone (the tensors' own checks aside):
// what decode_attn_run decides before it launches. The engine asks it before a rollout's decode steps (session 33:
// steps the kernel declines attend in SDPA over a bucket of the cache's slots).
bool decode_attn_takes(int64_t B, int64_t H, int64_t KV, int64_t S, int64_t D, int64_t dev, bool one_wave_only) {
  if ((D != 64 && D != 128) || KV < 1 || H % KV != 0 || H / KV > kAttnMaxGroup || B < 1 || B > 65535 ||
      KV > 65535 || B * KV > kAttnMaxPairs || S < 1)
    return false;
  const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
  const int d = static_cast<int>(dev);
  const int64_t pairs = B * KV;
  const bool cluster_ok = attn_cluster_env() && qerl_pdl::device_supports(d);
  const int64_t splits = attn_splits(d, pairs, S, D, 0, cluster_ok);
  if (splits < 1) return false;
  const bool one_wave = pairs * splits <= attn_wave(d, D);
  if (one_wave_only && !one_wave) return false;
  // (past one wave no cluster: the workspace must fit; within one, a workspace of so few blocks always does)
  return one_wave || pairs * splits * kAttnRecord <= (int64_t(1) << 28);
}

// decode_attn and rope_decode_attn past their own inputs' checks: B rows of H query heads, q (null where rope
// makes it)
static bool decode_attn_run(const bf16* q, int64_t B, int64_t H, at::Tensor& kc, at::Tensor& vc,
                            const at::Tensor& key_mask, const at::Tensor& slot, at::Tensor& out, double scale,
                            int64_t splits_req, int64_t cluster_req, bool one_wave_only, const AttnRope& rope) {
  const int dev = kc.get_device();
  if (!attn_bf16(kc, dev) || !attn_bf16(vc, dev) || !attn_bf16(out, dev) || kc.dim() != 4 || kc.sizes() != vc.sizes())
    return false;
  const int64_t D = kc.size(3), KV = kc.size(1), S = kc.size(2);
  if (kc.size(0) != B || (D != 64 && D != 128) || KV < 1 || H % KV != 0 || H / KV > kAttnMaxGroup ||
      out.numel() != B * H * D || B < 1 || B > 65535 || KV > 65535 || B * KV > kAttnMaxPairs || S < 1)
    return false;
  if (!key_mask.is_cuda() || key_mask.get_device() != dev || key_mask.scalar_type() != at::kBool ||
      key_mask.dim() != 2 || key_mask.size(0) != B || key_mask.size(1) < S || key_mask.stride(1) != 1 ||
      !slot.is_cuda() || slot.get_device() != dev || slot.scalar_type() != at::kLong || slot.numel() != 1)
    return false;
  const c10::cuda::CUDAGuard guard(kc.device());
  const int64_t pairs = B * KV;
  // (device_supports: this build's sm_90 code runs on the device, so the cluster instructions are real)
  const bool cluster_ok = (cluster_req < 0 ? attn_cluster_env() : cluster_req > 0) && qerl_pdl::device_supports(dev);
  const int64_t splits = attn_splits(dev, pairs, S, D, splits_req, cluster_ok);
  if (splits < 1) return false;
  const bool one_wave = pairs * splits <= attn_wave(dev, D);
  if (one_wave_only && !one_wave) return false;
  const bool cluster = cluster_ok && one_wave && splits > 1 && splits <= kAttnMaxCluster &&
                       (D == 128 ? attn_clusters_fit<128>(dev, pairs, splits, c10::cuda::getCurrentCUDAStream().stream())
                                 : attn_clusters_fit<64>(dev, pairs, splits, c10::cuda::getCurrentCUDAStream().stream()));
  if (splits > 1 && !cluster && pairs * splits * kAttnRecord > (int64_t(1) << 28)) return false;  // workspace > 1 GiB
  g_attn_last = cluster ? -splits : splits;
  if (D == 128)
    launch_decode_attn<128>(q, B, H, kc, vc, key_mask, slot, out, splits, scale, cluster, rope);
  else
    launch_decode_attn<64>(q, B, H, kc, vc, key_mask, slot, out, splits, scale, cluster, rope);
  return true;
}

bool decode_attn(const at::Tensor& q, at::Tensor& kc, at::Tensor& vc, const at::Tensor& key_mask,
                 const at::Tensor& slot, at::Tensor& out, double scale, int64_t splits_req, int64_t cluster_req,
                 bool one_wave_only) {
  if (!attn_bf16(q, kc.get_device()) || q.dim() != 4 || q.size(2) != 1 || kc.dim() != 4 || q.size(3) != kc.size(3))
    return false;
  return decode_attn_run(cptr(q), q.size(0), q.size(1), kc, vc, key_mask, slot, out, scale, splits_req, cluster_req,
                         one_wave_only, AttnRope{nullptr, 0, nullptr, nullptr, 0, 0});
}

// decode_attn with rope_kv's work in the same kernel (see csrc/decode_attn.cuh): y [B, (H + 2 KV) * D] rows (unit
// column stride, 16-byte aligned rows) of the fused q/k/v projection of the step's token, cos / sin [B, D] rows;
// the rotary k and v of the step's slot also go into the caches, as rope_kv writes them. False (nothing launched,
// nothing written) where decode_attn would decline or y, cos, sin do not fit.
bool rope_decode_attn(const at::Tensor& y, const at::Tensor& cos, const at::Tensor& sin, int64_t n_heads,
                      at::Tensor& kc, at::Tensor& vc, const at::Tensor& key_mask, const at::Tensor& slot,
                      at::Tensor& out, double scale, int64_t splits_req, int64_t cluster_req, bool one_wave_only) {
  const int dev = kc.get_device();
  auto rows = [&](const at::Tensor& t) {
    return t.is_cuda() && t.get_device() == dev && t.scalar_type() == at::kBFloat16 && t.dim() == 2 &&
           t.stride(1) == 1 && t.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  if (kc.dim() != 4 || !rows(y) || !rows(cos) || !rows(sin) || cos.sizes() != sin.sizes() ||
      cos.stride(0) != sin.stride(0) || n_heads < 1)
    return false;
  const int64_t B = kc.size(0), KV = kc.size(1), D = kc.size(3);
  if (y.size(0) != B || y.size(1) != (n_heads + 2 * KV) * D || cos.size(0) != B || cos.size(1) != D)
    return false;
  return decode_attn_run(nullptr, B, n_heads, kc, vc, key_mask, slot, out, scale, splits_req, cluster_req,
                         one_wave_only, AttnRope{cptr(y), y.stride(0), cptr(cos), cptr(sin), cos.stride(0),
                                                 static_cast<int>(n_heads)});
}

// one self-resetting ticket per row for sample_step_kernel, per (device, stream) (launches on one stream are
// serialized, so they can share it)
int* sample_counters(const at::Tensor& like) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, at::Tensor> cache;
  const int dev = like.get_device();
  const auto key = std::make_pair(dev, c10::cuda::getCurrentCUDAStream(dev).stream());
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, at::zeros({kSampleMaxRows}, like.options().dtype(at::kInt))).first;
  return it->second.data_ptr<int>();
}

// One sampling step (see sample_step_kernel): logits [rows, V] fp32 (unit column stride); finished [rows] bool;
// eos [n] int64; tok [rows] int64 (the step's tokens, out); out / mask / blp / tlp: [rows, T] int64 / bool / fp32
// / fp32 (contiguous, one shared shape), column `step` written; bad: one int32 (raised, never cleared). False
// (nothing launched) where the kernel does not take the tensors.
bool sample_step(const at::Tensor& logits, double temperature, int64_t seed, int64_t step, at::Tensor& finished,
                 const at::Tensor& eos, int64_t pad, at::Tensor& tok, at::Tensor& out, at::Tensor& mask,
                 at::Tensor& blp, at::Tensor& tlp, at::Tensor& bad) {
  const int dev = logits.get_device();
  if (!logits.is_cuda() || logits.scalar_type() != at::kFloat || logits.dim() != 2 || logits.stride(1) != 1 ||
      !(temperature > 0))
    return false;
  const int64_t rows = logits.size(0), V = logits.size(1);
  if (rows < 1 || rows > kSampleMaxRows || V < 1 || V >= (int64_t(1) << 30)) return false;
  auto on = [&](const at::Tensor& t, at::ScalarType st) {
    return t.is_cuda() && t.get_device() == dev && t.scalar_type() == st && t.is_contiguous();
  };
  if (!on(finished, at::kBool) || finished.numel() != rows || !on(eos, at::kLong) || !on(tok, at::kLong) ||
      tok.numel() != rows || !on(out, at::kLong) || !on(mask, at::kBool) || !on(blp, at::kFloat) ||
      !on(tlp, at::kFloat) || !on(bad, at::kInt) || bad.numel() != 1 || out.dim() != 2 || out.size(0) != rows ||
      mask.sizes() != out.sizes() || blp.sizes() != out.sizes() || tlp.sizes() != out.sizes() || step < 0 ||
      step >= out.size(1) || eos.numel() > 1024)
    return false;
  const c10::cuda::CUDAGuard guard(logits.device());
  const int sms = sm_count(dev);
  // about four blocks per SM, each slice at least 1,024 tokens, a multiple of 4 (one Philox block)
  int64_t S = std::min<int64_t>({(4 * sms + rows - 1) / rows, (V + 1023) / 1024, (int64_t)kSampleMaxSplit});
  S = std::max<int64_t>(S, 1);
  int64_t chunk = ((V + S - 1) / S + 3) / 4 * 4;
  S = (V + chunk - 1) / chunk;
  at::Tensor ws = at::empty({rows * S * 4}, logits.options());
  const uint64_t sd = static_cast<uint64_t>(seed);
  const uint2 key = make_uint2(static_cast<uint32_t>(sd), static_cast<uint32_t>(sd >> 32));
  C10_CUDA_CHECK(qerl_pdl::launch(
      sample_step_kernel, dim3(static_cast<unsigned>(rows), static_cast<unsigned>(S)), dim3(kSampleThreads), 0,
      c10::cuda::getCurrentCUDAStream().stream(), dev, logits.data_ptr<float>(), logits.stride(0), static_cast<int>(V),
      static_cast<float>(1.0 / temperature), key, static_cast<uint32_t>(step), static_cast<int>(chunk),
      reinterpret_cast<float4*>(ws.data_ptr<float>()), sample_counters(logits), finished.data_ptr<bool>(),
      eos.data_ptr<int64_t>(), static_cast<int>(eos.numel()), pad, tok.data_ptr<int64_t>(),
      out.data_ptr<int64_t>() + step, mask.data_ptr<bool>() + step, blp.data_ptr<float>() + step,
      tlp.data_ptr<float>() + step, out.size(1), bad.data_ptr<int>()));
  return true;
}

#endif  // QERL_NO_TORCH

}  // namespace qerl_fused

#ifndef QERL_NO_TORCH
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rmsnorm", &qerl_fused::add_rmsnorm,
        "h_out = h + d; x_out = rmsnorm(h_out) * w (bf16 rows); with a: hs = bf16(x_out @ a^T) (fp32)", py::arg("h"),
        py::arg("d"), py::arg("w"), py::arg("rows_per_w"), py::arg("h_out"), py::arg("x_out"), py::arg("eps"),
        py::arg("a") = py::none(), py::arg("hs") = py::none());
  m.def("silu_mul", &qerl_fused::silu_mul, "out = silu(g) * u (bf16 rows); with a: hs = bf16(out @ a^T) (fp32)",
        py::arg("g"), py::arg("u"), py::arg("out"), py::arg("a") = py::none(), py::arg("hs") = py::none());
  m.def("lora_expand", &qerl_fused::lora_expand,
        "out = y + hs @ bs for decode rows (M <= 16), hs from a fused shrink; false when the kernel does not take them",
        py::arg("hs"), py::arg("y"), py::arg("bs"), py::arg("out"), py::arg("segs") = std::vector<int64_t>());
  m.def("lora_shrink", &qerl_fused::lora_shrink,
        "hs = bf16(x @ a^T) as fp32 for decode rows (M <= 16); false when the kernel does not take them",
        py::arg("x"), py::arg("a"), py::arg("hs"));
  m.def("rope_kv", &qerl_fused::rope_kv, "rotary on q and k of a fused qkv row; k, v into the KV cache");
  m.def("lora_add", &qerl_fused::lora_add,
        "out = y + bf16(x @ a^T) @ bs for decode rows (M <= 16); false when the shapes need the matmul path",
        py::arg("x"), py::arg("a"), py::arg("y"), py::arg("bs"), py::arg("out"),
        py::arg("segs") = std::vector<int64_t>());
  m.def("sample_step", &qerl_fused::sample_step,
        "one decode step's sampling at temperature T without truncation (Gumbel-max, Philox) with its bookkeeping; "
        "false when the kernel does not take the tensors");
  m.def("decode_attn", &qerl_fused::decode_attn,
        "one decode step's attention over the KV cache (slots up to the step's, key mask); false when the kernel "
        "does not take the tensors",
        py::arg("q"), py::arg("kc"), py::arg("vc"), py::arg("key_mask"), py::arg("slot"), py::arg("out"),
        py::arg("scale"), py::arg("splits") = 0, py::arg("cluster") = -1, py::arg("one_wave_only") = false);
  m.def("rope_decode_attn", &qerl_fused::rope_decode_attn,
        "decode_attn with rope_kv's rotary and cache write of the step's fused q/k/v row in the same kernel; false "
        "when the kernel does not take the tensors",
        py::arg("y"), py::arg("cos"), py::arg("sin"), py::arg("n_heads"), py::arg("kc"), py::arg("vc"),
        py::arg("key_mask"), py::arg("slot"), py::arg("out"), py::arg("scale"), py::arg("splits") = 0,
        py::arg("cluster") = -1, py::arg("one_wave_only") = false);
  m.def("decode_attn_takes", &qerl_fused::decode_attn_takes,
        "whether decode_attn takes a step of B rows of H query heads over [B, KV, S, D] caches on a device, by shapes",
        py::arg("B"), py::arg("H"), py::arg("KV"), py::arg("S"), py::arg("D"), py::arg("device"),
        py::arg("one_wave_only") = false);
  m.def("decode_attn_last_splits", [] { return qerl_fused::g_attn_last; },
        "the last decode_attn launch's splits, negative when they were added in a thread-block cluster");
  m.def("set_attn_late_trigger", [](bool on) { qerl_fused::g_attn_late_trigger = on ? 1 : 0; },
        "decode_attn's PDL trigger once a block's loads have landed (true) or at its start (false)");
  m.def("set_pdl", [](bool on) { qerl_pdl::enabled_flag() = on ? 1 : 0; }, "programmatic dependent launch on/off");
}
#endif
