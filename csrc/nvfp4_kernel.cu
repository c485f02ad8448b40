// NVFP4 (E2M1 codes + e4m3 scale per 16 inputs + fp32 tensor scale G, a divisor) x BF16 kernels.
//
// Reads the packed layout of src/qerl_cli/layout.py ("qerl-nvfp4-tile16x64-v2"):
//   qweight uint8 [N_pad/16, K_pad/64, 576]: one record per 16 output rows x 64 inputs,
//   bytes [0,512): codes; lane L (g = L>>2, t = L&3) owns bytes [16L, 16L+16) = four uint32 words,
//   word j for inputs 16j..16j+15 of the tile, holding the mma.m16n8k16 A-fragment elements (register p, half h):
//   p=0 (row g, col 2t+h), p=1 (row g+8, col 2t+h), p=2 (row g, col 2t+8+h), p=3 (row g+8, col 2t+8+h), their
//   bits placed so that csrc/nvfp4_decode.cuh makes each register in 1-3 instructions.
//   bytes [512,576): e4m3 scales, byte 512 + 8g + 2j + r = scale of row g+8r, 16-input group j.
//
// Kernels
//   * nvfp4_mma_kernel  (small M, decode): out^T = W x^T with the weight tile as the A operand of
//     mma.sync.m16n8k16 (bf16 in, fp32 accumulate) and activations (tokens) as the 8 B columns.
//     E2M1 -> bf16 in registers (csrc/nvfp4_decode.cuh): the sign / exponent / mantissa bits of each code land
//     in a bf16's sign, low exponent bits and top mantissa bit, which yields value * 2^-126 (the 0.5
//     subnormal included); the e4m3 block scale is converted to bf16 as s * 2^64 (exact), one
//     bf16x2 multiply per fragment register gives value * s * 2^-62 exactly (a product of a
//     2-bit and a 4-bit significand), and the fp32 factor 2^62 / G is applied when the
//     result is written. Block scales are taken as non-negative (their sign bit is ignored: the quantizer
//     never writes negative scales). Split-K partial sums go to an fp32 workspace; the last CTA of a row group
//     (ticket counter, self-resetting) reduces them in a fixed order and writes bf16.
//   * nvfp4_dequant_kernel: dense [N, K] weight (bf16 / fp16 / fp32), bit-exact with the torch
//     reference (fp32 value * (float(s) / G), rounded once); used with cuBLAS for large M and for the
//     transposed product g @ W.
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "nvfp4_decode.cuh"
#include "check.cuh"
#include "pdl.cuh"
#include "warp_mma.cuh"

#ifndef QERL_NO_TORCH
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <cstdlib>
#include <map>
#include <tuple>
#include <mutex>
#include <utility>
#include <vector>
#endif

namespace qerl {

constexpr int kRecordBytes = 576;
constexpr int kCodeBytes = 512;
constexpr int kWarps = 4;          // warps per CTA of the mma kernel
constexpr int kSliceTokens = 64;   // tokens per CTA (largest TG = 8 token groups of 8)

struct WTile {
  uint4 c;  // this lane's 16 code bytes (4 words, one per 16-input sub-tile)
  uint2 s;  // the 8 scale bytes of this lane's row group g
};

__device__ __forceinline__ void load_tile(WTile& w, const uint8_t* rec, int lane) {
  const uint8_t* pc = rec + 16 * lane;
  const uint8_t* ps = rec + kCodeBytes + 8 * (lane >> 2);
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(w.c.x), "=r"(w.c.y), "=r"(w.c.z), "=r"(w.c.w)
               : "l"(pc));
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];"
               : "=r"(w.s.x), "=r"(w.s.y)
               : "l"(ps));
}

__device__ __forceinline__ uint32_t bf2u(__nv_bfloat162 v) { return *reinterpret_cast<uint32_t*>(&v); }
__device__ __forceinline__ __nv_bfloat162 u2bf(uint32_t v) { return *reinterpret_cast<__nv_bfloat162*>(&v); }

// Two e4m3 scales (bytes 2jj, 2jj+1 of sw: rows g and g+8) -> bf16x2 {s_g, s_g8} * 2^64, exact.
// (b & 0x7f) << 4 as bf16 bits is s * 2^-120 (e4m3 subnormals become bf16 subnormals, also exact);
// two bf16 multiplies by 2^120 and 2^64 (exact powers of two; bf16 mul keeps subnormal inputs).
template <int JJ>
__device__ __forceinline__ __nv_bfloat162 scale_pair(uint32_t sw7f) {
  // sw7f: the 4 scale bytes of two groups with the (always clear) sign bits masked off
  constexpr uint32_t sel = (2 * JJ) | (4 << 4) | ((2 * JJ + 1) << 8) | (4 << 12);
  const uint32_t t = __byte_perm(sw7f, 0u, sel) << 4;
  const __nv_bfloat162 k120 = u2bf(0x7B807B80u);  // 2^120
  const __nv_bfloat162 k64 = u2bf(0x5F805F80u);   // 2^64
  return __hmul2(__hmul2(u2bf(t), k120), k64);
}

// one output element: bf16(acc * alpha), then + bias[n] rounded again (what `y + bias` in bf16 does after the
// matmul, so the fused epilogue equals the unfused chain bit for bit)
__device__ __forceinline__ __nv_bfloat16 out_value(float v, const __nv_bfloat16* __restrict__ bias, int n) {
  const __nv_bfloat16 y = __float2bfloat16_rn(v);
  return bias ? __float2bfloat16_rn(__bfloat162float(y) + __bfloat162float(bias[n])) : y;
}

// Timeline probe builds only (-DQERL_TIMELINE; benchmarks/probe_timeline.py builds the extension as qerl_nvfp4_tl):
// thread 0 of every CTA of the small-M mma kernels stamps %globaltimer at entry, when its PDL wait returns, when
// its K loops end and when it leaves, and appends one 128-byte record to a device buffer (set_timeline). The
// stream-K kernel also stamps its first segment's K-loop end, when its last ticket was taken and when its last
// split-K sum ended, with its range's units. Normal builds compile all of it to nothing.
#ifdef QERL_TIMELINE
struct TlRecord {
  unsigned long long tag;   // (N << 32) | K
  unsigned long long qw;    // the packed weight's address (tells launches of a rotated chain apart)
  unsigned long long t_entry, t_wait, t_loop, t_exit;
  unsigned int block, grid, smid, flags;
  unsigned long long t_loop0;   // stream-K: the first segment's K-loop end (t_loop: the last one's)
  unsigned long long t_ticket;  // stream-K: when the last ticket this CTA took came back (0: none)
  unsigned long long t_sum;     // stream-K: when the last split-K sum this CTA made ended (0: none)
  unsigned int units0, units;   // stream-K: units of the first segment, of the whole range
  unsigned int nseg, pad;
  unsigned long long pad2[3];
};
static_assert(sizeof(TlRecord) == 128, "timeline record layout");
struct TlExtra {
  unsigned long long t_loop0 = 0, t_ticket = 0, t_sum = 0;
  unsigned int units0 = 0, units = 0, nseg = 0;
};
__device__ TlRecord* g_tl_buf = nullptr;
__device__ unsigned int g_tl_cap = 0;
__device__ unsigned int g_tl_count = 0;
__device__ __forceinline__ unsigned long long tl_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void tl_record(int N, int K, const void* qw, unsigned long long t0, unsigned long long tw,
                                          unsigned long long tl, unsigned int flags, const TlExtra& x) {
  if (threadIdx.x != 0 || g_tl_buf == nullptr) return;
  const unsigned long long te = tl_now();
  const unsigned int slot = atomicAdd(&g_tl_count, 1u);
  if (slot >= g_tl_cap) return;
  unsigned int smid;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
  TlRecord r;
  r.tag = ((unsigned long long)N << 32) | (unsigned int)K;
  r.qw = (unsigned long long)qw;
  r.t_entry = t0;
  r.t_wait = tw;
  r.t_loop = tl;
  r.t_exit = te;
  r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  r.grid = gridDim.x * gridDim.y * gridDim.z;
  r.smid = smid;
  r.flags = flags;
  r.t_loop0 = x.t_loop0;
  r.t_ticket = x.t_ticket;
  r.t_sum = x.t_sum;
  r.units0 = x.units0;
  r.units = x.units;
  r.nseg = x.nseg;
  r.pad = 0;
  r.pad2[0] = r.pad2[1] = r.pad2[2] = 0;
  g_tl_buf[slot] = r;
}
#define QERL_TL_BEGIN unsigned long long tl_t0 = tl_now(), tl_tw = 0, tl_tl = 0; TlExtra tl_x;
#define QERL_TL_WAITED tl_tw = tl_now();
#define QERL_TL_LOOPED tl_tl = tl_now();
#define QERL_TL_END(flags) tl_record(N, K, qw, tl_t0, tl_tw, tl_tl, (flags), tl_x);
#define QERL_TL_X(stmt) stmt;
#else
#define QERL_TL_BEGIN
#define QERL_TL_WAITED
#define QERL_TL_LOOPED
#define QERL_TL_END(flags)
#define QERL_TL_X(stmt)
#endif

// PDL prologue of the small-M kernels: L2 prefetch of a warp's first tiles of one row block (contiguous
// records), issued by lane 0 before qerl_pdl::wait()
constexpr int kPrefetchTiles = 16;
__device__ __forceinline__ void prefetch_tiles(const uint8_t* rec, int tiles, int lane) {
  if (lane == 0) qerl_pdl::prefetch_l2(rec, (uint32_t)(min(tiles, kPrefetchTiles) * kRecordBytes));
}

__device__ __forceinline__ void cp_async16(uint32_t saddr, const void* g, bool valid) {
  const int n = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(saddr), "l"(g), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Sub-tile j (16 inputs) of a lane's tile record: its 32-bit code word.
__device__ __forceinline__ uint32_t subtile_word(const WTile& t, int j) {
  return j == 0 ? t.c.x : j == 1 ? t.c.y : j == 2 ? t.c.z : t.c.w;
}

// The four A-fragment registers of one sub-tile word: E2M1 pairs -> bf16x2, times the row scales (row g, g + 8).
__device__ __forceinline__ void decode_subtile(uint32_t* a, uint32_t w, __nv_bfloat162 s_lo, __nv_bfloat162 s_hi) {
  a[0] = bf2u(__hmul2(u2bf(qerl_decode::reg<0>(w)), s_lo));
  a[1] = bf2u(__hmul2(u2bf(qerl_decode::reg<1>(w)), s_hi));
  a[2] = bf2u(__hmul2(u2bf(qerl_decode::reg<2>(w)), s_lo));
  a[3] = bf2u(__hmul2(u2bf(qerl_decode::reg<3>(w)), s_hi));
}

// The MMAs of one 32-input half (two sub-tiles) against every token group: B fragments from shared memory.
template <int TG, int R>
__device__ __forceinline__ void mma_half(float (&acc)[R][TG][4], const uint32_t (&a)[R][2][4], uint32_t lrow,
                                         const uint32_t (&lrow_off)[TG], uint32_t col_bytes) {
#pragma unroll
  for (int q = 0; q < TG; ++q) {
    uint32_t b[4];
    ldmatrix_x4(b, lrow + lrow_off[q] + col_bytes);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      mma_bf16(acc[r][q], a[r][0], b[0], b[1]);
      mma_bf16(acc[r][q], a[r][1], b[2], b[3]);
    }
  }
}

// Split-K reduction through distributed shared memory (sm_90 thread-block clusters): the S CTAs of one
// (slice, row group) form a cluster (cluster rank = split); each wrote its [mslice, ROWS] fp32 partial to its
// own shared memory. After a cluster barrier, CTA `split` sums outputs [split * per, (split + 1) * per) over the
// S partials in split order (0 + p0 + p1 + ...: the workspace path's order, bit for bit), then a second barrier
// keeps every CTA's shared memory alive until all remote reads are done.
constexpr int kMaxClusterSplit = 8;  // portable cluster size

template <int ROWS>
__device__ __forceinline__ void cluster_reduce(const float* part, __nv_bfloat16* __restrict__ out,
                                               const __nv_bfloat16* __restrict__ bias, float alpha, int tok0,
                                               int mslice, int N, int n0, int split, int S) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cluster_sync_all();
  uint32_t base[kMaxClusterSplit];
  const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(part));
#pragma unroll
  for (int s = 0; s < kMaxClusterSplit; ++s)
    if (s < S) asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(base[s]) : "r"(local), "r"(s));
  const int total = mslice * ROWS;
  const int per = (total + S - 1) / S;
  const int lo = split * per, hi = min(total, lo + per);
  const int nrows = min(ROWS, N - n0);
  for (int i = lo + (int)threadIdx.x; i < hi; i += (int)blockDim.x) {
    const int m = i / ROWS, nn = i % ROWS;
    if (nn >= nrows) continue;
    float p[kMaxClusterSplit];
#pragma unroll
    for (int s = 0; s < kMaxClusterSplit; ++s)  // all loads in flight before the ordered sum
      if (s < S) asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(p[s]) : "r"(base[s] + 4u * (uint32_t)i));
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplit; ++s)
      if (s < S) sum += p[s];
    out[(size_t)(tok0 + m) * N + n0 + nn] = out_value(sum * alpha, bias, n0 + nn);
  }
  cluster_sync_all();
#else
  __trap();  // the host launches clusters on sm_90 and newer only
#endif
}

// Deterministic stream-K fixup (nvfp4_mma_v2_kernel): element i = m * rows + nn (of `total`; nn >= nrows skipped) is the sum
// over the `nslots` partial slots j, at ws + slot_off(j) + i, added in slot order (0 + p0 + p1 + ...).
// Batched (session 7): each thread takes 4 elements at a time and keeps up to 4 x 8 loads in flight: the fixup is
// a tail on the kernel's critical path, so it is latency that counts here. Serial (session 6): one element at a
// time, four slots in flight. Which one is faster depends on M (the host picks, `fixup_for`).
template <int THREADS, typename SlotOff, typename Emit>
__device__ __forceinline__ void ordered_slot_sum(const float* ws, int total, int rows, int nrows, int nslots,
                                                 bool batched, SlotOff slot_off, Emit emit) {
  if (!batched) {
    for (int i = (int)threadIdx.x; i < total; i += THREADS) {
      if (i % rows >= nrows) continue;
      const float* pe = ws + i;
      float sum = 0.f;
      int j = 0;
      for (; j + 4 <= nslots; j += 4) {
        const float v0 = __ldcg(pe + slot_off(j)), v1 = __ldcg(pe + slot_off(j + 1));
        const float v2 = __ldcg(pe + slot_off(j + 2)), v3 = __ldcg(pe + slot_off(j + 3));
        sum += v0;
        sum += v1;
        sum += v2;
        sum += v3;
      }
      for (; j < nslots; ++j) sum += __ldcg(pe + slot_off(j));
      emit(i, sum);
    }
    return;
  }
  constexpr int EB = 4;
  for (int i0 = (int)threadIdx.x; i0 < total; i0 += EB * THREADS) {
    bool ok[EB];
    float sum[EB];
    const float* pe[EB];
#pragma unroll
    for (int e = 0; e < EB; ++e) {
      const int i = i0 + e * THREADS;
      ok[e] = i < total && (i % rows) < nrows;
      pe[e] = ws + (ok[e] ? i : 0);
      sum[e] = 0.f;
    }
    for (int j0 = 0; j0 < nslots; j0 += 8) {
      float p[EB][8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const size_t so = j0 + j < nslots ? slot_off(j0 + j) : 0;
#pragma unroll
        for (int e = 0; e < EB; ++e) p[e][j] = (ok[e] && j0 + j < nslots) ? __ldcg(pe[e] + so) : 0.f;
      }
#pragma unroll
      for (int e = 0; e < EB; ++e)
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (j0 + j < nslots) sum[e] += p[e][j];
    }
#pragma unroll
    for (int e = 0; e < EB; ++e)
      if (ok[e]) emit(i0 + e * THREADS, sum[e]);
  }
}

// A LoRA term inside the small-M kernels (decode steps; session 14): out = x W^T + hs @ bs (+ bias), with hs
// [M, R] holding bf16 values (the shrink bf16(x @ a^T)): fp32 in the instances for M <= 16 (as the kernels before
// make it: add + RMSNorm, SiLU·mul or fused.lora_shrink), bf16 in those for 16 < M <= 64 (session 15: a
// matmul's output; one load path per instance keeps the small ones' registers as they were) and bs [R, N] bf16
// (B^T times the scaling; block-diagonal for a fused group: the columns below col_end[i] read only rank rows
// [rbeg[i], rend[i])). A 16-row block's rank rows are MMAs of their own (bs
// as the A operand, hs as B, straight from global memory: L2-resident and small), after the K loop (the weight
// tiles' registers are free then), summed in fp32 and added, scaled by G / 2^62, to the accumulators of the last
// K split (nvfp4_mma_kernel) or of the segment that ends the row group's K range (nvfp4_mma_v2_kernel) before the
// split-K sum: base + term is rounded to bf16 once (the separate expand kernel rounds the base first, so the two
// differ in the last bit at most). The host (linear_lora_out) admits 16-aligned member boundaries and rank ranges
// only.
constexpr int kLoraAugSegs = 8;
constexpr int kLoraAugMaxTG = 8;  // every small-M instance (M <= 64) takes a term
constexpr int kLoraAugFp32MaxTG = 2;  // instances up to this TG read hs as fp32, the larger ones as bf16
struct LoraAug {
  const void* h;  // nullptr: no term
  const __nv_bfloat16* b;
  int R, nseg;
  int h_bf16;  // hs is bf16 (else fp32): must be what the instance reads (TG > kLoraAugFp32MaxTG), checked at launch
  int col_end[kLoraAugSegs], rbeg[kLoraAugSegs], rend[kLoraAugSegs];
};

// the rank rows [lo, hi) of bs that output row n0 (and its 16-row block) reads
__device__ __forceinline__ void lora_aug_rows(const LoraAug& la, int n0, int& lo, int& hi) {
  lo = hi = 0;
  bool found = false;
#pragma unroll
  for (int i = 0; i < kLoraAugSegs; ++i)  // (unrolled: the parameter arrays stay out of local memory)
    if (!found && i < la.nseg && n0 < la.col_end[i]) {
      lo = la.rbeg[i];
      hi = la.rend[i];
      found = true;
    }
}

// L2 prefetch of the bs slice a 16-row block's term reads (one line per rank row), spread over the warp's lanes:
// issued in the PDL prologue, as bs is read after the K loop and otherwise comes from DRAM then (a prefetch is
// correct whatever a kernel before writes)
__device__ __forceinline__ void lora_aug_prefetch(const LoraAug& la, int n0, int N, int lane) {
  int lo, hi;
  lora_aug_rows(la, n0, lo, hi);
  for (int j = lo + lane; j < hi; j += 32)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(la.b + (size_t)j * N + n0));
}

template <int TG, int R>
__device__ __forceinline__ void lora_aug_term(float (&acc)[R][TG][4], const LoraAug& la, const int (&rb)[R], int NT,
                                              int N, int tok0, int mslice, float scale, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const __nv_bfloat16 zero = __float2bfloat16_rn(0.f);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (rb[r] >= NT) continue;
    const int n0 = rb[r] * 16;
    int lo, hi;
    lora_aug_rows(la, n0, lo, hi);
    const int row0 = n0 + g, row1 = n0 + g + 8;
    auto bv = [&](int j, int row) { return row < N ? la.b[(size_t)j * N + row] : zero; };
    float c[TG][4];
#pragma unroll
    for (int q = 0; q < TG; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) c[q][i] = 0.f;
    for (int k = lo; k < hi; k += 16) {
      const int j0 = k + 2 * t, j8 = j0 + 8;
      uint32_t a[4];
      a[0] = bf2u(__halves2bfloat162(bv(j0, row0), bv(j0 + 1, row0)));
      a[1] = bf2u(__halves2bfloat162(bv(j0, row1), bv(j0 + 1, row1)));
      a[2] = bf2u(__halves2bfloat162(bv(j8, row0), bv(j8 + 1, row0)));
      a[3] = bf2u(__halves2bfloat162(bv(j8, row1), bv(j8 + 1, row1)));
#pragma unroll
      for (int q = 0; q < TG; ++q) {
        const int m = q * 8 + g;  // this lane's token (B column) of the token group
        uint32_t b0 = 0u, b1 = 0u;
        if (m < mslice) {
          const size_t at = (size_t)(tok0 + m) * la.R + j0;
          if constexpr (TG > kLoraAugFp32MaxTG) {
            const __nv_bfloat16* hp = static_cast<const __nv_bfloat16*>(la.h) + at;
            b0 = __ldcg(reinterpret_cast<const unsigned int*>(hp));
            b1 = __ldcg(reinterpret_cast<const unsigned int*>(hp + 8));
          } else {
            const float* hp = static_cast<const float*>(la.h) + at;
            const float2 v0 = __ldcg(reinterpret_cast<const float2*>(hp));
            const float2 v8 = __ldcg(reinterpret_cast<const float2*>(hp + 8));
            b0 = bf2u(__floats2bfloat162_rn(v0.x, v0.y));  // exact: hs holds bf16 values
            b1 = bf2u(__floats2bfloat162_rn(v8.x, v8.y));
          }
        }
        mma_bf16(c[q], a, b0, b1);
      }
    }
#pragma unroll
    for (int q = 0; q < TG; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][q][i] += c[q][i] * scale;
  }
}

// TG: token groups of 8 per CTA (M_slice <= 8*TG); R: row blocks (16 rows) per warp; D: K tiles of weight
// loads in flight per warp; KCH: K tiles of activations staged in shared memory per chunk; NACC: accumulator
// sets (2 splits the dependent mma chain when R*TG is small).
// the S split-K partials of output o (split s at ws[s * MN + o]), added in split order, eight loads in flight
__device__ __forceinline__ float sum_splits(const float* __restrict__ ws, int S, size_t MN, size_t o) {
  float sum = 0.f;
  for (int s0 = 0; s0 < S; s0 += 8) {
    float p[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) p[j] = s0 + j < S ? __ldcg(ws + (size_t)(s0 + j) * MN + o) : 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (s0 + j < S) sum += p[j];
  }
  return sum;
}

template <int TG, int R, int D, int KCH, int NACC, int MINB>
__global__ void __launch_bounds__(kWarps * 32, MINB) nvfp4_mma_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ qw, const float* __restrict__ gscale,
    const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out, float* __restrict__ ws,
    int* __restrict__ counters, int M, int N, int K, int NT, int KT, int S, int tiles_per_split, int cl,
    LoraAug la) {
  QERL_TL_BEGIN
  qerl_pdl::trigger();
  constexpr int MP = 8 * TG;           // token rows staged
  constexpr int LDX = KCH * 64 + 8;    // smem row stride (elements): +16 B keeps ldmatrix conflict-free
  constexpr int ROWS = kWarps * R * 16;
  // the cluster reduction keeps a [MP, ROWS] fp32 partial in the activation buffers: needs ROWS <= LDX
  static_assert(ROWS <= LDX, "cluster partial does not fit the staging buffers");
  extern __shared__ __align__(16) __nv_bfloat16 xs[];
  __shared__ int s_last;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int slice = blockIdx.x, rg = blockIdx.y, split = blockIdx.z;
  const int tok0 = slice * kSliceTokens;
  const int mslice = min(M - tok0, MP);
  // staged rows: the valid tokens plus one zero row that the ldmatrix lanes of absent tokens read
  const int rows_alloc = mslice < MP ? mslice + 1 : MP;
  const int CHUNK = rows_alloc * LDX;  // elements per buffer

  const int kt0 = split * tiles_per_split;
  const int kt1 = min(KT, kt0 + tiles_per_split);
  const int nchunks = (kt1 - kt0 + KCH - 1) / KCH;

  int rb[R];
  const uint8_t* rec[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    rb[r] = (rg * kWarps + warp) * R + r;
    rec[r] = qw + (size_t)min(rb[r], NT - 1) * KT * kRecordBytes;
  }

  // PDL prologue, while the kernel before us finishes: warm L2 with this warp's first tiles and load tiles
  // kt0 .. kt0 + D - 1 into registers (no kernel that triggers early writes a packed weight: pdl.cuh)
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (rb[r] < NT) prefetch_tiles(rec[r] + (size_t)kt0 * kRecordBytes, kt1 - kt0, lane);
  WTile wr[D][R];
#pragma unroll
  for (int d = 0; d < D; ++d)
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (kt0 + d < kt1) load_tile(wr[d][r], rec[r] + (size_t)(kt0 + d) * kRecordBytes, lane);
  if constexpr (TG <= kLoraAugMaxTG) {
    if (la.h != nullptr && split == S - 1) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (rb[r] < NT) lora_aug_prefetch(la, rb[r] * 16, N, lane);
    }
  }
  qerl_pdl::wait();
  QERL_TL_WAITED

  const uint32_t xs_base = static_cast<uint32_t>(__cvta_generic_to_shared(xs));
  // the zero row (index mslice) of both buffers; cp.async only ever writes rows < mslice
  if (mslice < MP) {
    for (int i = tid; i < 2 * (LDX / 8); i += kWarps * 32)
      *reinterpret_cast<uint4*>(xs + (i / (LDX / 8)) * CHUNK + mslice * LDX + (i % (LDX / 8)) * 8) =
          make_uint4(0, 0, 0, 0);
  }
  // per token group: this lane's ldmatrix row (token (lane & 7), or the zero row) and 8-input column block
  uint32_t lrow_off[TG];
#pragma unroll
  for (int q = 0; q < TG; ++q)
    lrow_off[q] = (uint32_t)((min(q * 8 + (lane & 7), mslice) * LDX + 8 * (lane >> 3)) * 2);
  auto stage = [&](int c) {
    const int kb = (kt0 + c * KCH) * 64;  // first input of the chunk
    const uint32_t sb = xs_base + (uint32_t)((c & 1) * CHUNK * 2);
    const int segs = mslice * KCH * 8;   // 16-byte segments of the valid rows
    for (int i = tid; i < segs; i += kWarps * 32) {
      const int m = i / (KCH * 8), sgi = i % (KCH * 8);
      const int kk = kb + sgi * 8;
      const bool valid = kk < K;
      const __nv_bfloat16* src = valid ? x + (size_t)(tok0 + m) * K + kk : x;
      cp_async16(sb + (uint32_t)((m * LDX + sgi * 8) * 2), src, valid);
    }
    cp_async_commit();
  };

  float acc[NACC][R][TG][4];
#pragma unroll
  for (int a = 0; a < NACC; ++a)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int q = 0; q < TG; ++q)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[a][r][q][i] = 0.f;

  // one 16x64 tile per row block: dequantize the A fragments in registers, 2 ldmatrix.x4 + 4 mma per token group
  auto compute = [&](const WTile (&cur)[R], uint32_t lrow, int ktl) {
#pragma unroll
    for (int jp = 0; jp < 2; ++jp) {
      uint32_t a[R][2][4];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t sw = (jp == 0 ? cur[r].s.x : cur[r].s.y) & 0x7F7F7F7Fu;
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const int j = 2 * jp + jj;
          const __nv_bfloat162 s2 = jj == 0 ? scale_pair<0>(sw) : scale_pair<1>(sw);
          decode_subtile(a[r][jj], subtile_word(cur[r], j), __low2bfloat162(s2), __high2bfloat162(s2));
        }
      }
      mma_half<TG, R>(acc[jp % NACC], a, lrow, lrow_off, (uint32_t)((ktl * 64 + 32 * jp) * 2));
    }
  };

  stage(0);
  for (int c = 0; c < nchunks; ++c) {
    if (c + 1 < nchunks) {
      stage(c + 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const uint32_t sb = xs_base + (uint32_t)((c & 1) * CHUNK * 2);
    const uint32_t lrow = sb;
    const int cbase = kt0 + c * KCH;
    const uint8_t* base[R];
#pragma unroll
    for (int r = 0; r < R; ++r) base[r] = rec[r] + (size_t)cbase * kRecordBytes;
    if (cbase + KCH + D <= kt1) {
      // full chunk: every prefetch is in range; constant offsets, no per-tile checks
#pragma unroll
      for (int i = 0; i < KCH; ++i) {
        WTile cur[R];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          cur[r] = wr[i % D][r];
          load_tile(wr[i % D][r], base[r] + (i + D) * kRecordBytes, lane);
        }
        compute(cur, lrow, i);
      }
    } else {
#pragma unroll
      for (int i = 0; i < KCH; ++i) {
        const int kt = cbase + i;
        WTile cur[R];
#pragma unroll
        for (int r = 0; r < R; ++r) cur[r] = wr[i % D][r];
        if (kt + D < kt1) {
#pragma unroll
          for (int r = 0; r < R; ++r) load_tile(wr[i % D][r], base[r] + (i + D) * kRecordBytes, lane);
        }
        if (kt < kt1) compute(cur, lrow, i);
      }
    }
    __syncthreads();  // buffer (c & 1) is refilled by stage(c + 2)
  }
  QERL_TL_LOOPED
  // the LoRA term (if any), in the last split
  if constexpr (TG <= kLoraAugMaxTG) {
    if (la.h != nullptr && split == S - 1)
      lora_aug_term<TG, R>(acc[0], la, rb, NT, N, tok0, mslice, __ldg(gscale) * 0x1p-62f, lane);
  }

  const float alpha = __fdiv_rn(0x1p62f, __ldg(gscale));  // 2^(126 - 64) / G
#pragma unroll
  for (int r = 0; r < R; ++r) {
#pragma unroll
    for (int q = 0; q < TG; ++q) {
      float v[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[i] = acc[0][r][q][i];
#pragma unroll
        for (int a = 1; a < NACC; ++a) v[i] += acc[a][r][q][i];
      }
      const bool rowblock_ok = rb[r] < NT;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = rb[r] * 16 + g + 8 * (i >> 1);
        const int m = q * 8 + 2 * t + (i & 1);
        if (rowblock_ok && n < N && m < mslice) {
          if (S == 1)
            out[(size_t)(tok0 + m) * N + n] = out_value(v[i] * alpha, bias, n);
          else if (cl)
            reinterpret_cast<float*>(xs)[m * ROWS + (n - rg * ROWS)] = v[i];  // staging buffers are free now
          else
            ws[((size_t)split * M + tok0 + m) * N + n] = v[i];
        }
      }
    }
  }
  if (S == 1) {
    QERL_TL_END(0u)
    return;
  }
  if (cl) {
    // split-K inside a thread-block cluster of the S splits: every CTA sums 1/S of the outputs, reading the
    // S partials from the CTAs' shared memory in split order (the same order and result as the workspace path)
    cluster_reduce<ROWS>(reinterpret_cast<const float*>(xs), out, bias, alpha, tok0, mslice, N, rg * ROWS, split, S);
    QERL_TL_END(1u)
    return;
  }

  // split-K: the last CTA of this (row group, slice) sums the S partials in split order
  __threadfence();
  __syncthreads();
  if (tid == 0) {
    const int prev = atomicAdd(&counters[rg * gridDim.x + slice], 1);
    s_last = (prev == S - 1);
  }
  __syncthreads();
  if (!s_last) {
    QERL_TL_END(2u)
    return;
  }
  __threadfence();
  const int n0 = rg * ROWS;
  const int nrows = min(ROWS, N - n0);
  for (int i = tid; i < mslice * ROWS; i += kWarps * 32) {
    const int m = i / ROWS, nn = i % ROWS;
    if (nn >= nrows) continue;
    const size_t o = (size_t)(tok0 + m) * N + n0 + nn;
    const float sum = sum_splits(ws, S, (size_t)M * N, o);
    out[o] = out_value(sum * alpha, bias, n0 + nn);
  }
  if (tid == 0) counters[rg * gridDim.x + slice] = 0;  // ready for the next launch on this stream
  QERL_TL_END(3u)
}

// ---------------------------------------------------------------------------------------------------------
// nvfp4_mma_v2_kernel: small-M (decode) variant, chosen by auto_variant for large weights or forced with
// set_variant(2) / set_variant(4) (Python: kernel.set_variant("v2") / ("v2w8"), or QERL_KERNEL_VARIANT); NW warps
// per block (4 or 8). Same tile records, same E2M1 / scale arithmetic (the A
// fragments are bit-identical to nvfp4_mma_kernel's), differences:
//   * stream-K work split: the grid is the resident CTA count (or fewer for small problems); the RG * KT
//     (row group, K tile) units are cut into P equal contiguous ranges, one per CTA, so every CTA streams the
//     same number of tiles (no wave tail). A row group cut between CTAs is summed deterministically: each CTA
//     writes its (at most two) partial row-group sums to its own fp32 slots; the last CTA to finish a row
//     group (ticket counter, self-resetting) adds the slots in CTA order and writes bf16.
//   * fewer instructions per tile: the two scale pairs of a 32-bit scale word come from one shift + mask each
//     ({row g: group 2jp, 2jp+1} and {row g+8: ...}) instead of a byte permute + shift per pair, and the
//     weight loads use immediate offsets from one base pointer per chunk (no 64-bit address arithmetic per
//     tile).
template <int I, int N, typename F>
__device__ __forceinline__ void static_for(F&& f) {
  if constexpr (I < N) {
    f(std::integral_constant<int, I>{});
    static_for<I + 1, N>(f);
  }
}

template <int OFF>
__device__ __forceinline__ void load_tile_at(WTile& w, const uint8_t* pc, const uint8_t* ps) {
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4+%5];"
               : "=r"(w.c.x), "=r"(w.c.y), "=r"(w.c.z), "=r"(w.c.w)
               : "l"(pc), "n"(OFF));
  asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2+%3];" : "=r"(w.s.x), "=r"(w.s.y) : "l"(ps), "n"(OFF));
}

// the 4 e4m3 scales of a scale word (bytes: (group 2jp, row g), (2jp, g+8), (2jp+1, g), (2jp+1, g+8)) ->
// r0 = {s(2jp, g), s(2jp+1, g)} and r8 = {s(2jp, g+8), s(2jp+1, g+8)}, each bf16 s * 2^64, exact (as scale_pair)
__device__ __forceinline__ void scale_quad(uint32_t sw, __nv_bfloat162& r0, __nv_bfloat162& r8) {
  const __nv_bfloat162 k120 = u2bf(0x7B807B80u);  // 2^120
  const __nv_bfloat162 k64 = u2bf(0x5F805F80u);   // 2^64
  const uint32_t te = (sw << 4) & 0x07F007F0u;    // bytes 0, 2 (sign bits dropped) as s * 2^-120
  const uint32_t to = (sw >> 4) & 0x07F007F0u;    // bytes 1, 3
  r0 = __hmul2(__hmul2(u2bf(te), k120), k64);
  r8 = __hmul2(__hmul2(u2bf(to), k120), k64);
}

__device__ __forceinline__ __nv_bfloat162 bf_lo2(__nv_bfloat162 v) { return __low2bfloat162(v); }
__device__ __forceinline__ __nv_bfloat162 bf_hi2(__nv_bfloat162 v) { return __high2bfloat162(v); }

__device__ __forceinline__ int64_t sk_begin(int64_t b, int64_t W, int64_t P) { return b * W / P; }
// the CTA whose range holds unit u
__device__ __forceinline__ int sk_owner(int64_t u, int64_t W, int64_t P) { return (int)(((u + 1) * P - 1) / W); }

// Pair mode of the stream-K kernel (linear_silu_out: a fused gate/up weight, gate rows [0, N/2), up rows [N/2, N)):
// logical 16-row block 2j is gate block j and 2j + 1 is up block j, so every row group holds both halves of its
// outputs and writes silu(gate) * up, [M, N/2], instead of the [M, N] product. The stream-K split runs over the
// logical (interleaved) rows: the same as the v2w8 product of the block-interleaved weight.
__device__ __forceinline__ int pair_block(int rb, int NT, int pair) {
  return pair ? ((rb & 1) ? (NT >> 1) + (rb >> 1) : (rb >> 1)) : rb;
}

// silu_mul of qerl_fused (csrc/fused_ops.cu), bit for bit: bf16(float(bf16(silu(float(g)))) * float(u))
__device__ __forceinline__ __nv_bfloat16 silu_mul1(__nv_bfloat16 g, __nv_bfloat16 u) {
  const float x = __bfloat162float(g);
  return __float2bfloat16_rn(__bfloat162float(__float2bfloat16_rn(x / (1.0f + expf(-x)))) * __bfloat162float(u));
}

// a row group's fp32 sums sums[m * ROWS + nl] (logical rows, nrows of them valid) -> out[m, col0 + q] =
// silu_mul(bf16(gate * alpha), bf16(up * alpha)), q over the group's ROWS / 2 output columns (out row stride ldo)
template <int THREADS, int ROWS>
__device__ __forceinline__ void pair_epilogue(const float* sums, __nv_bfloat16* __restrict__ out, float alpha,
                                              int mslice, int nrows, int ldo, int col0) {
  constexpr int HALF = ROWS / 2;
  for (int p = (int)threadIdx.x; p < mslice * HALF; p += THREADS) {
    const int m = p / HALF, q = p % HALF;
    const int ng = (q >> 4) * 32 + (q & 15);  // the gate row of output column q; its up row is ng + 16
    if (ng + 16 >= nrows) continue;
    const __nv_bfloat16 gv = __float2bfloat16_rn(sums[m * ROWS + ng] * alpha);
    const __nv_bfloat16 uv = __float2bfloat16_rn(sums[m * ROWS + ng + 16] * alpha);
    out[(size_t)m * ldo + col0 + q] = silu_mul1(gv, uv);
  }
}

template <int TG, int R, int D, int KCH, int NACC, int MINB, int NW, bool PAIR = false, bool CL = false>
__global__ void __launch_bounds__(NW * 32, MINB) nvfp4_mma_v2_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ qw, const float* __restrict__ gscale,
    const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out, float* __restrict__ ws,
    int* __restrict__ counters, int M, int N, int K, int NT, int KT, int RG, int batched_fixup, LoraAug la) {
  constexpr int pair = PAIR ? 1 : 0;
#ifdef QERL_V2_PREFETCH_LOOP
  // (a build with the rolling L2 prefetch: batched_fixup's bits 8-15 are the K loop's prefetch distance in tiles,
  // 0 only the PDL prologue's first kPrefetchTiles; v2_flags)
  const int pf_ahead = (batched_fixup >> 8) & 0xff;
  batched_fixup &= 1;
#endif
  QERL_TL_BEGIN
#ifdef QERL_TIMELINE
  unsigned int tl_fixups = 0;
#endif
  qerl_pdl::trigger();
  constexpr int MP = 8 * TG;           // token rows staged (M <= MP: one slice)
  constexpr int LDX = KCH * 64 + 8;    // smem row stride (elements)
  constexpr int ROWS = NW * R * 16;
  extern __shared__ __align__(16) __nv_bfloat16 xs[];
  __shared__ int s_last;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int mslice = min(M, MP);
  const int rows_alloc = mslice < MP ? mslice + 1 : MP;
  const int CHUNK = rows_alloc * LDX;
  const int64_t P = gridDim.x, W = (int64_t)RG * KT;
  const int b = blockIdx.x;
  const int64_t u0 = sk_begin(b, W, P), u1 = sk_begin(b + 1, W, P);

  // PDL prologue: warm L2 with this warp's first tiles (of the first row group in its range)
  if (u0 < u1) {
    const int rg0 = (int)(u0 / KT), kta = (int)(u0 - (int64_t)rg0 * KT);
    const int ktb = (int)min((int64_t)KT, (int64_t)kta + (u1 - u0));
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int rbr = (rg0 * NW + warp) * R + r;
      if (rbr < NT) prefetch_tiles(qw + ((size_t)pair_block(rbr, NT, pair) * KT + kta) * kRecordBytes, ktb - kta, lane);
    }
  }
  // the LoRA term's bs slices of the row groups whose K range ends in this CTA's range (they add the term)
  if constexpr (TG <= kLoraAugMaxTG) {
    if (la.h != nullptr && u0 < u1) {
      for (int rg = (int)(u0 / KT); (int64_t)rg * KT + KT - 1 < u1; ++rg)
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int rbr = (rg * NW + warp) * R + r;
          if (rbr < NT) lora_aug_prefetch(la, pair_block(rbr, NT, pair) * 16, N, lane);
        }
    }
  }
  // (the wait comes after the first segment's register loads of the weight, in the loop below)

  const uint32_t xs_base = static_cast<uint32_t>(__cvta_generic_to_shared(xs));
  // pair mode: a row group's [mslice, ROWS] fp32 sums, in the staging buffers (free after a segment's K loop):
  // row m of the sums lies inside staging row m of buffer 0, so the zero row (index mslice) stays zero
  static_assert(2 * ROWS <= LDX, "pair sums do not fit the staging rows");
  float* const pbuf = reinterpret_cast<float*>(xs);
  if (mslice < MP) {
    for (int i = tid; i < 2 * (LDX / 8); i += NW * 32)
      *reinterpret_cast<uint4*>(xs + (i / (LDX / 8)) * CHUNK + mslice * LDX + (i % (LDX / 8)) * 8) =
          make_uint4(0, 0, 0, 0);
  }
  uint32_t lrow_off[TG];
#pragma unroll
  for (int q = 0; q < TG; ++q)
    lrow_off[q] = (uint32_t)((min(q * 8 + (lane & 7), mslice) * LDX + 8 * (lane >> 3)) * 2);
  const float alpha = __fdiv_rn(0x1p62f, __ldg(gscale));  // 2^(126 - 64) / G

  for (int64_t u = u0; u < u1;) {
    const int rg = (int)(u / KT);
    const int kt0 = (int)(u - (int64_t)rg * KT);
    const int kt1 = (int)min((int64_t)KT, (int64_t)kt0 + (u1 - u));
    const bool first_seg = (u == u0);
    u += kt1 - kt0;
    const int nchunks = (kt1 - kt0 + KCH - 1) / KCH;

    int rb[R];
    const uint8_t* pc[R];  // this lane's code bytes of tile kt0
    const uint8_t* ps[R];  // this lane's scale bytes of tile kt0
#pragma unroll
    for (int r = 0; r < R; ++r) {
      rb[r] = (rg * NW + warp) * R + r;
      const uint8_t* rec = qw + ((size_t)pair_block(min(rb[r], NT - 1), NT, pair) * KT + kt0) * kRecordBytes;
      pc[r] = rec + 16 * lane;
      ps[r] = rec + kCodeBytes + 8 * g;
    }
    WTile wr[D][R];
    static_for<0, D>([&](auto di) {
      constexpr int d = decltype(di)::value;
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (kt0 + d < kt1) load_tile_at<d * kRecordBytes>(wr[d][r], pc[r], ps[r]);
    });
    // PDL: the first segment's first tiles are loaded while the kernel before us finishes (no kernel that
    // triggers early writes a packed weight: pdl.cuh); everything below reads activations or writes
    if (first_seg) {
      qerl_pdl::wait();
      QERL_TL_WAITED
    }

    auto stage = [&](int c) {
      const int kb = (kt0 + c * KCH) * 64;
      const uint32_t sb = xs_base + (uint32_t)((c & 1) * CHUNK * 2);
      const int segs = mslice * KCH * 8;
      for (int i = tid; i < segs; i += NW * 32) {
        const int m = i / (KCH * 8), sgi = i % (KCH * 8);
        const int kk = kb + sgi * 8;
        const bool valid = kk < K;
        const __nv_bfloat16* src = valid ? x + (size_t)m * K + kk : x;
        cp_async16(sb + (uint32_t)((m * LDX + sgi * 8) * 2), src, valid);
      }
      cp_async_commit();
    };

    float acc[NACC][R][TG][4];
#pragma unroll
    for (int a = 0; a < NACC; ++a)
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int q = 0; q < TG; ++q)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[a][r][q][i] = 0.f;

    auto compute = [&](const WTile(&cur)[R], uint32_t lrow, int ktl) {
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        uint32_t a[R][2][4];
#pragma unroll
        for (int r = 0; r < R; ++r) {
          __nv_bfloat162 s0, s8;
          scale_quad(jp == 0 ? cur[r].s.x : cur[r].s.y, s0, s8);
#pragma unroll
          for (int jj = 0; jj < 2; ++jj) {
            const int j = 2 * jp + jj;
            decode_subtile(a[r][jj], subtile_word(cur[r], j), jj == 0 ? bf_lo2(s0) : bf_hi2(s0),  // row g
                           jj == 0 ? bf_lo2(s8) : bf_hi2(s8));                                      // row g + 8
          }
        }
        mma_half<TG, R>(acc[jp % NACC], a, lrow, lrow_off, (uint32_t)((ktl * 64 + 32 * jp) * 2));
      }
    };

    stage(0);
    for (int c = 0; c < nchunks; ++c) {
      if (c + 1 < nchunks) {
        stage(c + 1);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
      __syncthreads();
      const uint32_t lrow = xs_base + (uint32_t)((c & 1) * CHUNK * 2);
      const int cbase = kt0 + c * KCH;
#ifdef QERL_V2_PREFETCH_LOOP
      if (pf_ahead > 0 && lane == 0) {
        // rolling L2 prefetch: this chunk's tiles pf_ahead ahead (at the first chunk also those between the end
        // of the prologue's prefetch, or the segment start, and there): more bytes in flight than the D register
        // tiles per warp hold, without the registers; values unchanged
        const int lo = c == 0 ? kt0 + (first_seg ? kPrefetchTiles : 0) : cbase + pf_ahead;
        const int hi = min(kt1, cbase + pf_ahead + KCH);
        if (lo < hi) {
#pragma unroll
          for (int r = 0; r < R; ++r)
            if (rb[r] < NT)
              qerl_pdl::prefetch_l2(pc[r] + (size_t)(lo - cbase) * kRecordBytes, (uint32_t)((hi - lo) * kRecordBytes));
        }
      }
#endif
      if (cbase + KCH + D <= kt1) {
        static_for<0, KCH>([&](auto ii) {
          constexpr int i = decltype(ii)::value;
          WTile cur[R];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            cur[r] = wr[i % D][r];
            load_tile_at<(i + D) * kRecordBytes>(wr[i % D][r], pc[r], ps[r]);
          }
          compute(cur, lrow, i);
        });
      } else {
        static_for<0, KCH>([&](auto ii) {
          constexpr int i = decltype(ii)::value;
          const int kt = cbase + i;
          WTile cur[R];
#pragma unroll
          for (int r = 0; r < R; ++r) cur[r] = wr[i % D][r];
          if (kt + D < kt1) {
#pragma unroll
            for (int r = 0; r < R; ++r) load_tile_at<(i + D) * kRecordBytes>(wr[i % D][r], pc[r], ps[r]);
          }
          if (kt < kt1) compute(cur, lrow, i);
        });
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        pc[r] += KCH * kRecordBytes;
        ps[r] += KCH * kRecordBytes;
      }
      __syncthreads();  // buffer (c & 1) is refilled by stage(c + 2)
    }
    QERL_TL_LOOPED
    QERL_TL_X(if (first_seg) { tl_x.t_loop0 = tl_tl; tl_x.units0 = (unsigned)(kt1 - kt0); tl_x.units = (unsigned)(u1 - u0); })
    QERL_TL_X(tl_x.nseg += 1u)
    // the LoRA term (if any), in the segment that ends the row group's K range (one CTA's)
    if constexpr (TG <= kLoraAugMaxTG) {
      if (la.h != nullptr && kt1 == KT) {
        int prb[R];  // the physical row blocks (pair mode: gate block j or up block j), whose bs columns apply
#pragma unroll
        for (int r = 0; r < R; ++r) prb[r] = rb[r] < NT ? pair_block(rb[r], NT, pair) : rb[r];
        lora_aug_term<TG, R>(acc[0], la, prb, NT, N, 0, mslice, __ldg(gscale) * 0x1p-62f, lane);
      }
    }

    const bool whole = (kt0 == 0 && kt1 == KT);
    const int slot = first_seg ? 0 : 1;
    float* wsb = ws + (size_t)(2 * b + slot) * M * ROWS;  // [M][ROWS] partial of this CTA
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
      for (int q = 0; q < TG; ++q) {
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          v[i] = acc[0][r][q][i];
#pragma unroll
          for (int a = 1; a < NACC; ++a) v[i] += acc[a][r][q][i];
        }
        const bool rowblock_ok = rb[r] < NT;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int nl = (warp * R + r) * 16 + g + 8 * (i >> 1);  // row within the row group
          const int n = rg * ROWS + nl;
          const int m = q * 8 + 2 * t + (i & 1);
          if (rowblock_ok && n < N && m < mslice) {
            if ((whole && pair) || CL)
              pbuf[m * ROWS + nl] = v[i];
            else if (whole)
              out[(size_t)m * N + n] = out_value(v[i] * alpha, bias, n);
            else
              wsb[(size_t)m * ROWS + nl] = v[i];
          }
        }
      }
    }
    if (whole) {
      if (pair) {
        __syncthreads();
        pair_epilogue<NW * 32, ROWS>(pbuf, out, alpha, mslice, min(ROWS, N - rg * ROWS), N / 2, rg * (ROWS / 2));
        __syncthreads();  // pbuf (the staging buffers) is refilled by the next segment
      }
      continue;
    }
    if constexpr (CL) {  // (launched on an aligned grid as clusters of its s splits: this CTA's one segment is
                         // split cluster_rank() of the row group; the host never pairs CL with PAIR)
      cluster_reduce<ROWS>(pbuf, out, bias, alpha, 0, mslice, N, rg * ROWS, cluster_rank(), cluster_size());
      QERL_TL_X(tl_fixups |= 64u)
      continue;
    }

    // a row group cut between CTAs: the last of its CTAs adds the partials in CTA order
    __threadfence();
    __syncthreads();
    const int bfirst = sk_owner((int64_t)rg * KT, W, P);
    const int blast = sk_owner((int64_t)rg * KT + KT - 1, W, P);
    if (tid == 0) {
      const int prev = atomicAdd(&counters[rg], 1);
      s_last = (prev == blast - bfirst);
    }
    __syncthreads();
    QERL_TL_X(tl_x.t_ticket = tl_now())
    if (s_last) {
      __threadfence();
      const int n0 = rg * ROWS;
      const int nrows = min(ROWS, N - n0);
      // slot 1 of the first CTA only when its range starts inside an earlier row group
      const size_t slot_stride = (size_t)M * ROWS;
      const size_t first_slot = (size_t)(2 * bfirst + (sk_begin(bfirst, W, P) >= (int64_t)rg * KT ? 0 : 1));
      ordered_slot_sum<NW * 32>(ws, mslice * ROWS, ROWS, nrows, blast - bfirst + 1, batched_fixup != 0,
                                [&](int j) {
        return (j == 0 ? first_slot : (size_t)(2 * (bfirst + j))) * slot_stride;
      }, [&](int i, float sum) {
        if (pair) {
          pbuf[i] = sum;
          return;
        }
        const int m = i / ROWS, nn = i % ROWS;
        out[(size_t)m * N + n0 + nn] = out_value(sum * alpha, bias, n0 + nn);
      });
      if (pair) {
        __syncthreads();
        pair_epilogue<NW * 32, ROWS>(pbuf, out, alpha, mslice, nrows, N / 2, rg * (ROWS / 2));
      }
      if (tid == 0) counters[rg] = 0;  // ready for the next launch on this stream
#ifdef QERL_TIMELINE
      tl_x.t_sum = tl_now();
      tl_fixups += 1u;
      if (u < u1) tl_fixups |= 32u;  // a sum before this block's last segment
#endif
    }
    __syncthreads();  // s_last is rewritten by the next segment
  }
  QERL_TL_END(16u + tl_fixups)  // 16 + the row groups this CTA summed (v2), + 32 if one came before its last
                                // segment, + 64 if its split-K sum went through its cluster
}

// ---------------------------------------------------------------------------------------------------------
// dense dequantization: one CTA = one row block x 8 K tiles (one record per warp), staged through shared
// memory so the [N, K] output is written with coalesced 16-byte stores.
template <typename T>
__device__ __forceinline__ void store2(T* p, float a, float b);
template <>
__device__ __forceinline__ void store2<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <>
__device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}
template <>
__device__ __forceinline__ void store2<__half>(__half* p, float a, float b) {
  *reinterpret_cast<__half2*>(p) = __floats2half2_rn(a, b);
}

__device__ __forceinline__ float e4m3_to_float(uint32_t b) {
  // exponent/mantissa bits placed at fp32 bits 30..20: s * 2^-120 (fp32 subnormal for e4m3 subnormals)
  return __uint_as_float(((b & 0x7Fu) << 20) | ((b & 0x80u) << 24)) * 0x1p120f;
}

constexpr int kDqTiles = 8;  // K tiles per CTA

// one CTA of the dequantize kernels (256 threads): the 16 rows of row block rb over the K tiles [kt0, kt0 + kDqTiles)
template <typename T>
__device__ __forceinline__ void dequant_block(const uint8_t* __restrict__ qw, const float* __restrict__ gscale,
                                              T* __restrict__ out, int N, int K, int KT, int rb, int kt0) {
  constexpr int E = 16 / sizeof(T);          // elements per 16-byte store
  constexpr int LD = kDqTiles * 64 + E;      // padded smem row
  __shared__ __align__(16) T tile[16 * LD];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int kt = kt0 + warp;
  if (kt < KT) {
    const uint8_t* rec = qw + ((size_t)rb * KT + kt) * kRecordBytes;
    const uint4 c = *reinterpret_cast<const uint4*>(rec + 16 * lane);
    const uint2 s = *reinterpret_cast<const uint2*>(rec + kCodeBytes + 8 * g);
    const float G = __ldg(gscale);
    const uint32_t words[4] = {c.x, c.y, c.z, c.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t sw = j < 2 ? s.x : s.y;
      const float sg0 = __fdiv_rn(e4m3_to_float((sw >> (16 * (j & 1))) & 0xFFu), G);      // row g
      const float sg1 = __fdiv_rn(e4m3_to_float((sw >> (16 * (j & 1) + 8)) & 0xFFu), G);  // row g + 8
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const float sg = (p & 1) ? sg1 : sg0;
        const uint32_t v = qerl_decode::reg_at(words[j], p);  // two codes as value * 2^-126 (bf16 bits)
        const float v0 = __uint_as_float(v << 16) * 0x1p126f * sg;         // h = 0 (exact until * sg)
        const float v1 = __uint_as_float(v & 0xFFFF0000u) * 0x1p126f * sg;  // h = 1
        const int row = g + 8 * (p & 1);
        const int col = warp * 64 + 16 * j + 2 * t + 8 * (p >> 1);
        store2<T>(&tile[row * LD + col], v0, v1);
      }
    }
  }
  __syncthreads();
  const int ncols = min(kDqTiles * 64, K - kt0 * 64);
  const int nrows = min(16, N - rb * 16);
  constexpr int CPR = kDqTiles * 64 / E;  // 16-byte chunks per row
  for (int i = tid; i < 16 * CPR; i += 256) {
    const int row = i / CPR, col = (i % CPR) * E;
    if (row < nrows && col < ncols)
      *reinterpret_cast<uint4*>(out + (size_t)(rb * 16 + row) * K + kt0 * 64 + col) =
          *reinterpret_cast<const uint4*>(&tile[row * LD + col]);
  }
}

template <typename T>
__global__ void __launch_bounds__(256) nvfp4_dequant_kernel(const uint8_t* __restrict__ qw,
                                                            const float* __restrict__ gscale,
                                                            T* __restrict__ out, int N, int K, int NT, int KT) {
  dequant_block<T>(qw, gscale, out, N, K, KT, blockIdx.y, blockIdx.x * kDqTiles);
}

// nvfp4_dequant_many_kernel (session 33): up to kDqMany packed weights into their bf16 copies in one launch (the
// engine's batched decode steps above the small-M range dequantize a whole layer's weights at once, not one launch
// per projection). CTAs [start[e], start[e + 1]) take weight e, in nvfp4_dequant_kernel's tiling (the same bits).
constexpr int kDqMany = 8;
struct DqMany {
  const uint8_t* qw[kDqMany];
  const float* gs[kDqMany];
  __nv_bfloat16* out[kDqMany];
  int n[kDqMany], k[kDqMany], kt[kDqMany], kch[kDqMany], start[kDqMany];
  int count;
};

__global__ void __launch_bounds__(256) nvfp4_dequant_many_kernel(const DqMany d) {
  const int bid = blockIdx.x;
  int e = 0;
#pragma unroll
  for (int i = 1; i < kDqMany; ++i)  // (constant indices: the parameters stay in the constant bank)
    if (i < d.count && bid >= d.start[i]) e = i;
  const uint8_t* qw = d.qw[0];
  const float* gs = d.gs[0];
  __nv_bfloat16* out = d.out[0];
  int n = d.n[0], k = d.k[0], kt = d.kt[0], kch = d.kch[0], start = d.start[0];
#pragma unroll
  for (int i = 1; i < kDqMany; ++i)
    if (i == e) qw = d.qw[i], gs = d.gs[i], out = d.out[i], n = d.n[i], k = d.k[i], kt = d.kt[i], kch = d.kch[i],
      start = d.start[i];
  const int local = bid - start;
  dequant_block<__nv_bfloat16>(qw, gs, out, n, k, kt, local / kch, (local % kch) * kDqTiles);
}

// ---------------------------------------------------------------------------------------------------------
// nvfp4_tc_kernel (session 23): the tiled tensor-core path for mid M (batched decode at batch 64-512, prefill chunks,
// log-prob passes of small batches), where the small-M kernels re-read their staged activations per 64 tokens and
// dequantize + cuBLAS pays for writing and reading a bf16 copy of the weight. One CTA computes a tile of
// WR * R * 16 output rows x WT * TG * 8 tokens; its K range is cut into 64-input tiles that move through a
// kTcStages-deep cp.async pipeline, both operands through shared memory: the tile records as they lie in the packed
// weight (each lane's 16 code bytes and 8 scale bytes are its A fragments, decoded in registers exactly as in the
// small-M kernels) and the activations as [tokens][64 + 8] bf16 rows (144-byte rows: ldmatrix conflict-free). Warp
// (wr, wt) owns R row blocks x TG token groups; every weight fragment meets TG token groups and every activation
// fragment R row blocks. Split-K (the host picks S so that the grid fills the GPU): fp32 partials in a workspace,
// the last CTA of a tile (ticket counter, self-resetting) adds them in split order, as the small-M kernels do.
constexpr int kTcStages = 4;

template <int WR, int WT, int R, int TG>
struct TcCfg {
  static constexpr int kThreads = WR * WT * 32;
  static constexpr int kRowBlocks = WR * R;  // 16-row blocks per CTA
  static constexpr int kRows = kRowBlocks * 16;
  static constexpr int kTokens = WT * TG * 8;
  static constexpr int kLdx = 72;  // staged activation row: 64 inputs + 8 (elements)
  static constexpr int kWBytes = kRowBlocks * kRecordBytes;
  static constexpr int kXBytes = kTokens * kLdx * 2;
  static constexpr int kStageBytes = kWBytes + kXBytes;
  static constexpr int kLdo = kRows + 8;  // bf16 output staging row (elements)
  static constexpr int kSmem = kTcStages * kStageBytes;
  static_assert(kWBytes % 16 == 0 && kStageBytes % 16 == 0, "16-byte aligned stages");
  static_assert(kTokens * kLdo * 2 <= kSmem, "output staging fits the pipeline buffers");
};

__device__ __forceinline__ void lds128(uint4& v, uint32_t a) {
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
}
__device__ __forceinline__ void lds64(uint2& v, uint32_t a) {
  asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(a));
}

// The tiled kernels' epilogue: warp (wr, wt) = (warp % WR, warp / WR) holds acc[r][q][i] of output row
// (wr * R + r) * 16 + g + 8 * (i >> 1) and token wt * TG * 8 + q * 8 + 2 * t + (i & 1) of the CTA's tile (the
// mma.sync C layout, which wgmma's accumulators share). S == 1: bf16 results staged in `smem` (the free pipeline
// buffers) and written out in 16-byte pieces; S > 1: the split's fp32 partial into the workspace, the last CTA of
// the tile adds them in split order.
template <int WR, int WT, int R, int TG>
__device__ __forceinline__ void tc_epilogue(const float (&acc)[R][TG][4], uint8_t* smem, const float* __restrict__ gscale,
                                            const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out,
                                            float* __restrict__ ws, int* __restrict__ counters, int M, int N, int S,
                                            int split, int rt, int mt, int rb0, int tok0, int vec_out) {
  using C = TcCfg<WR, WT, R, TG>;
  __shared__ int s_last;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = warp % WR, wt = warp / WR;
  const int g = lane >> 2, t = lane & 3;
  const float alpha = __fdiv_rn(0x1p62f, __ldg(gscale));  // 2^(126 - 64) / G
  const int n0 = rb0 * 16;
  const int nrows = min(C::kRows, N - n0), mrows = min(C::kTokens, M - tok0);
  if (S == 1) {
    // bf16 results staged as [token][row], then written out in 16-byte pieces along the rows
    __nv_bfloat16* ob = reinterpret_cast<__nv_bfloat16*>(smem);
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int q = 0; q < TG; ++q)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int nl = (wr * R + r) * 16 + g + 8 * (i >> 1);
          const int ml = wt * TG * 8 + q * 8 + 2 * t + (i & 1);
          if (nl < nrows) ob[ml * C::kLdo + nl] = out_value(acc[r][q][i] * alpha, bias, n0 + nl);
        }
    __syncthreads();
    if (vec_out) {  // N % 8 == 0 and out 16-byte aligned (the host checks)
      constexpr int CPR = C::kRows / 8;
      for (int c = tid; c < mrows * CPR; c += C::kThreads) {
        const int ml = c / CPR, nl = (c % CPR) * 8;
        if (nl < nrows)
          *reinterpret_cast<uint4*>(out + (size_t)(tok0 + ml) * N + n0 + nl) =
              *reinterpret_cast<const uint4*>(ob + ml * C::kLdo + nl);
      }
    } else {
      for (int c = tid; c < mrows * C::kRows; c += C::kThreads) {
        const int ml = c / C::kRows, nl = c % C::kRows;
        if (nl < nrows) out[(size_t)(tok0 + ml) * N + n0 + nl] = ob[ml * C::kLdo + nl];
      }
    }
    return;
  }
  // split-K: this split's fp32 partial into the workspace; the last CTA of the tile adds them in split order
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int q = 0; q < TG; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int nl = (wr * R + r) * 16 + g + 8 * (i >> 1);
        const int ml = wt * TG * 8 + q * 8 + 2 * t + (i & 1);
        if (nl < nrows && ml < mrows) ws[((size_t)split * M + tok0 + ml) * N + n0 + nl] = acc[r][q][i];
      }
  __threadfence();
  __syncthreads();
  const int ticket = mt * gridDim.x + rt;
  if (tid == 0) s_last = atomicAdd(&counters[ticket], 1) == S - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  for (int c = tid; c < mrows * C::kRows; c += C::kThreads) {
    const int ml = c / C::kRows, nl = c % C::kRows;
    if (nl >= nrows) continue;
    const size_t o = (size_t)(tok0 + ml) * N + n0 + nl;
    const float sum = sum_splits(ws, S, (size_t)M * N, o);
    out[o] = out_value(sum * alpha, bias, n0 + nl);
  }
  if (tid == 0) counters[ticket] = 0;  // ready for the next launch on this stream
}

template <int WR, int WT, int R, int TG, int MINB>
__global__ void __launch_bounds__(WR * WT * 32, MINB) nvfp4_tc_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ qw, const float* __restrict__ gscale,
    const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out, float* __restrict__ ws,
    int* __restrict__ counters, int M, int N, int K, int NT, int KT, int S, int tiles_per_split, int vec_out) {
  using C = TcCfg<WR, WT, R, TG>;
  extern __shared__ __align__(16) uint8_t tc_smem[];
  qerl_pdl::trigger();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wr = warp % WR, wt = warp / WR;
  const int g = lane >> 2;
  const int rt = blockIdx.x, mt = blockIdx.y, split = blockIdx.z;
  const int rb0 = rt * C::kRowBlocks, tok0 = mt * C::kTokens;
  const int kt0 = split * tiles_per_split;
  const int ntiles = min(KT, kt0 + tiles_per_split) - kt0;
  const uint32_t sbase = static_cast<uint32_t>(__cvta_generic_to_shared(tc_smem));

  qerl_pdl::wait();
  // K tile kt0 + i into slot i % kTcStages (an empty commit group past the range keeps the group count uniform)
  auto load_stage = [&](int i) {
    if (i < ntiles) {
      const int kt = kt0 + i;
      const uint32_t sw = sbase + (uint32_t)((i % kTcStages) * C::kStageBytes);
      const uint32_t sx = sw + C::kWBytes;
      for (int c = tid; c < C::kRowBlocks * (kRecordBytes / 16); c += C::kThreads) {
        const int b = c / (kRecordBytes / 16), o = c % (kRecordBytes / 16);
        const bool ok = rb0 + b < NT;  // row blocks past the weight: zeros (their outputs are not written)
        const uint8_t* src = qw + ((size_t)(ok ? rb0 + b : 0) * KT + kt) * kRecordBytes + 16 * o;
        cp_async16(sw + (uint32_t)(b * kRecordBytes + 16 * o), src, ok);
      }
      for (int c = tid; c < C::kTokens * 8; c += C::kThreads) {
        const int m = c >> 3, o = c & 7;
        const int kk = kt * 64 + 8 * o;
        const bool ok = tok0 + m < M && kk < K;  // absent tokens and inputs past K: zeros
        const __nv_bfloat16* src = ok ? x + (size_t)(tok0 + m) * K + kk : x;
        cp_async16(sx + (uint32_t)((m * C::kLdx + 8 * o) * 2), src, ok);
      }
    }
    cp_async_commit();
  };
#pragma unroll
  for (int i = 0; i < kTcStages - 1; ++i) load_stage(i);

  // this lane's ldmatrix row (token) and 8-input column block in token group 0 (group q: + q * 8 rows)
  const uint32_t lrow0 = (uint32_t)(((wt * TG * 8 + (lane & 7)) * C::kLdx + 8 * (lane >> 3)) * 2);
  float acc[R][TG][4];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int q = 0; q < TG; ++q)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][q][i] = 0.f;

  for (int i = 0; i < ntiles; ++i) {
    cp_async_wait<kTcStages - 2>();
    __syncthreads();  // tile i has landed for every thread; slot (i - 1) % kTcStages is free again
    load_stage(i + kTcStages - 1);
    const uint32_t sw = sbase + (uint32_t)((i % kTcStages) * C::kStageBytes);
    WTile cur[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint32_t rec = sw + (uint32_t)((wr * R + r) * kRecordBytes);
      lds128(cur[r].c, rec + 16 * lane);
      lds64(cur[r].s, rec + kCodeBytes + 8 * g);
    }
#pragma unroll
    for (int jp = 0; jp < 2; ++jp) {
      uint32_t a[R][2][4];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t sw7f = (jp == 0 ? cur[r].s.x : cur[r].s.y) & 0x7F7F7F7Fu;
#pragma unroll
        for (int jj = 0; jj < 2; ++jj) {
          const __nv_bfloat162 s2 = jj == 0 ? scale_pair<0>(sw7f) : scale_pair<1>(sw7f);
          decode_subtile(a[r][jj], subtile_word(cur[r], 2 * jp + jj), __low2bfloat162(s2), __high2bfloat162(s2));
        }
      }
      const uint32_t xb = sw + C::kWBytes + lrow0 + (uint32_t)(32 * jp * 2);
#pragma unroll
      for (int q = 0; q < TG; ++q) {
        uint32_t b[4];
        ldmatrix_x4(b, xb + (uint32_t)(q * 8 * C::kLdx * 2));
#pragma unroll
        for (int r = 0; r < R; ++r) {
          mma_bf16(acc[r][q], a[r][0], b[0], b[1]);
          mma_bf16(acc[r][q], a[r][1], b[2], b[3]);
        }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers are free: output staging below

  tc_epilogue<WR, WT, R, TG>(acc, tc_smem, gscale, bias, out, ws, counters, M, N, S, split, rt, mt, rb0, tok0,
                             vec_out);
}

// ---------------------------------------------------------------------------------------------------------
// nvfp4_wg_kernel (session 24): the tiled path on Hopper's warpgroup MMA (sm_90a only; elsewhere it traps and the
// host never picks it). wgmma.mma_async takes its A operand from registers in the mma.sync A fragment layout, 16
// rows per warp, so each warp decodes its row block's tile record (the same lane bytes, scales and decode as the
// other kernels) straight into the four A registers of each 16-input sub-tile; the warpgroup's m64nNk16 multiplies
// its 64 rows with the NTOK staged tokens, which the tensor cores read from shared memory through a matrix
// descriptor: K-major, 128-byte swizzle (token m's 64 inputs are one 128-byte row, its 16-byte piece c stored at
// c ^ (m % 8); 8-row atoms 1024 bytes apart). A CTA of WG warpgroups computes WG * 64 rows x NTOK tokens (a
// token tile read once per WG * 64 rows). The K tiles move through a kWgStages-deep cp.async pipeline, prefetched
// two ahead, so a slot is refilled only after the wgmma groups that read it have completed: each step waits for
// the previous step's group (wgmma.wait_group 1) while its own runs, the A registers alternating between two
// sets. Split-K and the epilogue as in nvfp4_tc_kernel (the accumulators share the mma.sync C layout).
constexpr int kWgStages = 4;

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// this thread's cp.async (generic proxy) writes, made visible to the async proxy through which wgmma reads
__device__ __forceinline__ void fence_proxy_async_smem() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// descriptor of a K-major, 128-byte-swizzled operand at shared address `addr` (8-row atoms 1024 bytes apart)
__device__ __forceinline__ uint64_t wg_desc_sw128(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFF) >> 4) | ((uint64_t)1 << 16) | ((uint64_t)(1024 >> 4) << 32) |
         ((uint64_t)1 << 62);
}
__device__ __forceinline__ void wgmma_m64n64(float* d, const uint32_t (&a)[4], uint64_t desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
#else
  __trap();
#endif
}

__device__ __forceinline__ void wgmma_m64n128(float* d, const uint32_t (&a)[4], uint64_t desc) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
      :
        "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
#else
  __trap();
#endif
}

template <int NTOK>
__device__ __forceinline__ void wgmma_tokens(float* d, const uint32_t (&a)[4], uint64_t desc) {
  static_assert(NTOK == 64 || NTOK == 128, "wgmma token tile");
  if constexpr (NTOK == 64) wgmma_m64n64(d, a, desc);
  else wgmma_m64n128(d, a, desc);
}

template <int WG, int NTOK>
struct WgCfg {
  static constexpr int kThreads = WG * 128;
  static constexpr int kRowBlocks = WG * 4;
  static constexpr int kRows = kRowBlocks * 16;
  static constexpr int kTokens = NTOK;
  static constexpr int kXBytes = NTOK * 128;  // [NTOK][64] bf16, 128-byte swizzle
  static constexpr int kWBytes = kRowBlocks * kRecordBytes;
  static constexpr int kStageBytes = (kXBytes + kWBytes + 1023) / 1024 * 1024;  // every token tile 1024-aligned
  static constexpr int kSmem = kWgStages * kStageBytes + 1024;                  // + the base's alignment
  using Epi = TcCfg<WG * 4, 1, 1, NTOK / 8>;  // the epilogue's view: warp w owns row block w, all NTOK tokens
  static_assert(Epi::kThreads == kThreads && Epi::kRows == kRows && Epi::kTokens == kTokens, "epilogue view");
  static_assert(NTOK * Epi::kLdo * 2 <= kSmem, "output staging fits the pipeline buffers");
};

template <int WG, int NTOK, int MINB>
__global__ void __launch_bounds__(WG * 128, MINB) nvfp4_wg_kernel(
    const __nv_bfloat16* __restrict__ x, const uint8_t* __restrict__ qw, const float* __restrict__ gscale,
    const __nv_bfloat16* __restrict__ bias, __nv_bfloat16* __restrict__ out, float* __restrict__ ws,
    int* __restrict__ counters, int M, int N, int K, int NT, int KT, int S, int tiles_per_split, int vec_out) {
  using C = WgCfg<WG, NTOK>;
  extern __shared__ __align__(16) uint8_t wg_smem[];
  qerl_pdl::trigger();
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2;
  const int rt = blockIdx.x, mt = blockIdx.y, split = blockIdx.z;
  const int rb0 = rt * C::kRowBlocks, tok0 = mt * C::kTokens;
  const int kt0 = split * tiles_per_split;
  const int ntiles = min(KT, kt0 + tiles_per_split) - kt0;
  const uint32_t sraw = static_cast<uint32_t>(__cvta_generic_to_shared(wg_smem));
  const uint32_t sbase = (sraw + 1023u) & ~1023u;

  qerl_pdl::wait();
  // K tile kt0 + i into slot i % kWgStages: [token tile][the CTA's weight records] (an empty commit group past
  // the range keeps the group count uniform)
  auto load_stage = [&](int i) {
    if (i < ntiles) {
      const int kt = kt0 + i;
      const uint32_t sx = sbase + (uint32_t)((i % kWgStages) * C::kStageBytes);
      const uint32_t sw = sx + C::kXBytes;
      for (int c = tid; c < C::kRowBlocks * (kRecordBytes / 16); c += C::kThreads) {
        const int b = c / (kRecordBytes / 16), o = c % (kRecordBytes / 16);
        const bool ok = rb0 + b < NT;  // row blocks past the weight: zeros (their outputs are not written)
        const uint8_t* src = qw + ((size_t)(ok ? rb0 + b : 0) * KT + kt) * kRecordBytes + 16 * o;
        cp_async16(sw + (uint32_t)(b * kRecordBytes + 16 * o), src, ok);
      }
      for (int c = tid; c < NTOK * 8; c += C::kThreads) {
        const int m = c >> 3, o = c & 7;
        const int kk = kt * 64 + 8 * o;
        const bool ok = tok0 + m < M && kk < K;  // absent tokens and inputs past K: zeros
        const __nv_bfloat16* src = ok ? x + (size_t)(tok0 + m) * K + kk : x;
        cp_async16(sx + (uint32_t)(m * 128 + ((o ^ (m & 7)) << 4)), src, ok);
      }
    }
    cp_async_commit();
  };
  load_stage(0);
  load_stage(1);

  float acc[1][NTOK / 8][4];
#pragma unroll
  for (int q = 0; q < NTOK / 8; ++q)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[0][q][i] = 0.f;

  // K tile i: this warp's row block decoded into A registers `a`, then the warpgroup's four wgmmas (one per 16
  // inputs: the descriptor's start moves 32 bytes along the swizzled rows)
  auto step = [&](int i, uint32_t (&a)[4][4]) {
    cp_async_wait<1>();  // tile i has landed (tile i + 1 may still be in flight)
    fence_proxy_async_smem();
    __syncthreads();  // ... for every thread; every warpgroup has finished the wgmmas of tile i - 2
    load_stage(i + 2);  // into tile i - 2's slot
    const uint32_t sx = sbase + (uint32_t)((i % kWgStages) * C::kStageBytes);
    const uint32_t rec = sx + C::kXBytes + (uint32_t)(warp * kRecordBytes);
    WTile cur;
    lds128(cur.c, rec + 16 * lane);
    lds64(cur.s, rec + kCodeBytes + 8 * g);
#pragma unroll
    for (int jp = 0; jp < 2; ++jp) {
      const uint32_t sw7f = (jp == 0 ? cur.s.x : cur.s.y) & 0x7F7F7F7Fu;
#pragma unroll
      for (int jj = 0; jj < 2; ++jj) {
        const __nv_bfloat162 s2 = jj == 0 ? scale_pair<0>(sw7f) : scale_pair<1>(sw7f);
        decode_subtile(a[2 * jp + jj], subtile_word(cur, 2 * jp + jj), __low2bfloat162(s2), __high2bfloat162(s2));
      }
    }
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_tokens<NTOK>(&acc[0][0][0], a[j], wg_desc_sw128(sx + (uint32_t)(32 * j)));
    wgmma_commit();
    wgmma_wait<1>();  // tile i - 1's group is complete: its A registers and its slot may be reused
  };
  uint32_t a0[4][4], a1[4][4];
  int i = 0;
  for (; i + 1 < ntiles; i += 2) {
    step(i, a0);
    step(i + 1, a1);
  }
  if (i < ntiles) step(i, a0);
  wgmma_wait<0>();
  cp_async_wait<0>();
  __syncthreads();  // the pipeline buffers are free: output staging below
  tc_epilogue<WG * 4, 1, 1, NTOK / 8>(acc, wg_smem, gscale, bias, out, ws, counters, M, N, S, split, rt, mt, rb0,
                                       tok0, vec_out);
}


// the tiled kernel's configurations (WR, WT, R, TG, MINB): 128 rows x 128 tokens (8 warps, 174 registers), 128 x 64
// (8 warps, 128 registers), 128 x 64 (4 warps, 168 registers); none spills (ptxas, sm_90a)
#define QERL_TC_CONFIGS(X) \
  X(4, 2, 2, 8, 1)         \
  X(4, 2, 2, 4, 2)         \
  X(4, 1, 2, 8, 2)

// the wgmma kernel's configurations (WG, NTOK, MINB): tiled cfgs 4, 5, 6
#define QERL_WG_CONFIGS(X) \
  X(2, 128, 1)             \
  X(4, 128, 1)             \
  X(2, 64, 2)              \
  X(1, 128, 2)

#define QERL_MMA_CONFIGS(X) \
  X(1, 1, 6, 12, 2, 6)            \
  X(1, 1, 4, 8, 2, 7)             \
  X(2, 1, 8, 16, 2, 3)            \
  X(2, 2, 4, 8, 1, 3)             \
  X(4, 2, 4, 8, 1, 3)             \
  X(8, 1, 2, 4, 1, 3)             \
  X(4, 4, 2, 4, 1, 2)             \
  X(8, 2, 2, 4, 1, 2)

// the stream-K kernel: v2 (4 warps, set_variant(2)) and v2w8 (8 warps, set_variant(4)), each for M <= 8, 16, 32
// and 64 (the last two since session 10, forced only: not measured yet)
#define QERL_MMA_V2_CONFIGS(X) \
  X(1, 1, 4, 8, 2, 5, 4)          \
  X(2, 1, 4, 8, 2, 4, 4)          \
  X(4, 1, 4, 8, 1, 3, 4)          \
  X(8, 1, 2, 4, 1, 3, 4)          \
  X(1, 1, 4, 8, 2, 2, 8)          \
  X(2, 1, 4, 8, 2, 2, 8)          \
  X(4, 1, 4, 8, 1, 2, 8)          \
  X(8, 1, 2, 4, 1, 2, 8)          \
  X(1, 1, 4, 8, 2, 2, 10)         \
  X(2, 1, 4, 8, 2, 2, 10)

#ifdef QERL_NO_TORCH
// explicit instances for a stand-alone `nvcc -Xptxas -v` resource report
#define QERL_INSTANCE(TG, R, D, KCH, NACC, MINB)                                                             \
  template __global__ void nvfp4_mma_kernel<TG, R, D, KCH, NACC, MINB>(                                      \
      const __nv_bfloat16*, const uint8_t*, const float*, const __nv_bfloat16*, __nv_bfloat16*, float*, int*, int, \
      int, int, int, int, int, int, int, LoraAug);
QERL_MMA_CONFIGS(QERL_INSTANCE)
#define QERL_V2_INSTANCE(TG, R, D, KCH, NACC, MINB, NW)                                                      \
  template __global__ void nvfp4_mma_v2_kernel<TG, R, D, KCH, NACC, MINB, NW>(                               \
      const __nv_bfloat16*, const uint8_t*, const float*, const __nv_bfloat16*, __nv_bfloat16*, float*, int*, int, \
      int, int, int, int, int, int, LoraAug);
QERL_MMA_V2_CONFIGS(QERL_V2_INSTANCE)
#define QERL_V2_PAIR_INSTANCE(TG, R, D, KCH, NACC, MINB, NW)                                                 \
  template __global__ void nvfp4_mma_v2_kernel<TG, R, D, KCH, NACC, MINB, NW, true>(                         \
      const __nv_bfloat16*, const uint8_t*, const float*, const __nv_bfloat16*, __nv_bfloat16*, float*, int*, int, \
      int, int, int, int, int, int, LoraAug);
QERL_V2_PAIR_INSTANCE(1, 1, 4, 8, 2, 2, 8)
QERL_V2_PAIR_INSTANCE(2, 1, 4, 8, 2, 2, 8)
QERL_V2_PAIR_INSTANCE(4, 1, 4, 8, 1, 2, 8)
QERL_V2_PAIR_INSTANCE(8, 1, 2, 4, 1, 2, 8)
template __global__ void nvfp4_mma_v2_kernel<1, 1, 4, 8, 2, 2, 8, false, true>(
    const __nv_bfloat16*, const uint8_t*, const float*, const __nv_bfloat16*, __nv_bfloat16*, float*, int*, int, int,
    int, int, int, int, int, LoraAug);
template __global__ void nvfp4_mma_v2_kernel<2, 1, 4, 8, 2, 2, 8, false, true>(
    const __nv_bfloat16*, const uint8_t*, const float*, const __nv_bfloat16*, __nv_bfloat16*, float*, int*, int, int,
    int, int, int, int, int, LoraAug);
QERL_V2_PAIR_INSTANCE(1, 1, 4, 8, 2, 2, 10)
QERL_V2_PAIR_INSTANCE(2, 1, 4, 8, 2, 2, 10)
#define QERL_TC_INSTANCE(WR, WT, R, TG, MINB)                                                              \
  template __global__ void nvfp4_tc_kernel<WR, WT, R, TG, MINB>(const __nv_bfloat16*, const uint8_t*, const float*, \
                                                                const __nv_bfloat16*, __nv_bfloat16*, float*, int*,  \
                                                                int, int, int, int, int, int, int, int);
QERL_TC_CONFIGS(QERL_TC_INSTANCE)
#define QERL_WG_INSTANCE(WG, NTOK, MINB)                                                                     \
  template __global__ void nvfp4_wg_kernel<WG, NTOK, MINB>(const __nv_bfloat16*, const uint8_t*, const float*,   \
                                                           const __nv_bfloat16*, __nv_bfloat16*, float*, int*, int, \
                                                           int, int, int, int, int, int, int);
QERL_WG_CONFIGS(QERL_WG_INSTANCE)
template __global__ void nvfp4_dequant_kernel<__nv_bfloat16>(const uint8_t*, const float*, __nv_bfloat16*, int,
                                                              int, int, int);
template __global__ void nvfp4_dequant_kernel<float>(const uint8_t*, const float*, float*, int, int, int, int);
#endif

}  // namespace qerl

#ifndef QERL_NO_TORCH
// ---------------------------------------------------------------------------------------------------------
// host side
namespace qerl {

constexpr int kNumSMsDefault = 132;
static int64_t g_large_m_threshold = 64;  // M above this: dequantize + cuBLAS
static int g_variant = 3;  // 3: auto (per shape, below)
// split-K of nvfp4_mma_kernel through thread-block clusters (sm_90+); QERL_CLUSTER=0 or set_cluster(false): the
// fp32 workspace and ticket path
static int g_cluster = [] {
  const char* e = std::getenv("QERL_CLUSTER");
  return (e && e[0] == '0') ? 0 : 1;
}();
static int64_t g_cluster_max_m = [] {  // clusters up to this M (measured to help up to 32; QERL_CLUSTER_MAX_M)
  const char* e = std::getenv("QERL_CLUSTER_MAX_M");
  return (int64_t)(e && *e ? std::atoll(e) : 32);
}();
// stream-K fixup of the v2 kernel (ordered_slot_sum): 0 auto (fixup_for), 1 batched, 2 serial (QERL_FIXUP)
static int g_fixup = [] {
  const char* e = std::getenv("QERL_FIXUP");
  return (e && (e[0] == '1' || e[0] == '2')) ? e[0] - '0' : 0;
}();
// Auto: serial while every thread has at most one element to sum (M <= 2: M * 16 * NW elements, 32 * NW threads),
// where it measured 1-8 % faster (session 8 A/B in one build, benchmarks/results/ab_fixup_s8_h200.json: M = 1, 7B
// down 18.3 against 19.6 us); batched from M = 8 on, 2-8 % faster (M = 8: 7B down 20.8 against 22.6, 32B q/k/v
// 13.1 against 14.3; M = 16: 7B gate_up 33.8 against 35.6); M = 4 was a wash.
static int fixup_for(int64_t M) { return g_fixup ? (g_fixup == 1 ? 1 : 0) : (M > 2 ? 1 : 0); }
// the K loop's rolling L2 prefetch distance of the stream-K kernels, in tiles (0: off; set_v2_prefetch), in a
// build with -DQERL_V2_PREFETCH_LOOP only (session 29, not yet measured: the default build's kernels stay the
// measured ones, instruction for instruction)
static int g_v2_prefetch = 0;
#ifdef QERL_V2_PREFETCH_LOOP
constexpr bool kV2PrefetchBuilt = true;
#else
constexpr bool kV2PrefetchBuilt = false;
#endif
// the stream-K kernel's batched_fixup argument: the fixup mode, and in a prefetch build the distance in bits 8-15
static int v2_flags(int64_t M) { return fixup_for(M) | (g_v2_prefetch << 8); }
static int64_t g_split_override = 0;  // > 0: that K split (tests, benchmarks)
static int64_t g_v2_grid = 0;  // > 0: the stream-K kernel's CTA count (probes; at most its units), 0: chosen per shape
static int g_v2_aligned = 1;   // the stream-K kernel's grid aligned with its row groups where that fills the GPU
static int64_t g_last_v2_grid = 0;  // the CTA count of the last stream-K launch (tests)
static int g_v2_cluster = 1;        // aligned grids' split-K sums through thread-block clusters (sm_90)
static int g_last_v2_cluster = 0;   // the cluster size of the last stream-K launch (0: none; tests)
// g_tc_max_m: linear_out's auto path takes the tiled kernel for g_large_m_threshold < M <= g_tc_max_m (0: never;
// QERL_TC_MAX_M). g_tc_cfg: 0 auto (tc_auto_cfg), 1-7 one configuration (run_tc). g_tc_split: > 0 that K split
// (tests, benchmarks), 0 chosen per shape.
static int64_t g_tc_max_m = [] {
  const char* e = std::getenv("QERL_TC_MAX_M");
  return (int64_t)(e && *e ? std::atoll(e) : 0);
}();
static int g_tc_cfg = 0;
static int64_t g_tc_split = 0;
static int64_t g_last_tc = 0;  // the last tiled launch: cfg * 1000 + K split (tests)

// Row-group-aligned grids of the stream-K kernel (session 21, benchmarks/results/s21/, H100): the timeline probe
// found the CTAs whose equal share of the RG * KT units crosses a row group's end late (down at M = 8: their K
// loops end 2.6 us after the median one, up to 6.4): the first segment's partial store, fence and ticket and the
// second segment's pipeline fill sit in the middle of their range. With RG * s CTAs, s of each row group's K
// range apiece, no CTA crosses one (sk_begin(r * s + j) = r * KT + j * KT / s). probe_partition.py swept s at M =
// 1, 8 and 16 against the default grid (every resident slot): 7B down 18.2 / 19.5 / 23.0 us at s = 8 (KT = 296 =
// 8 * 37) against 22.1 / 24.3 / 29.4; o 6.9 / 8.4 / 11.2 at s = 8 against 11.7 / 13.2 / 16.9 (and against the v1
// kernel's 8.1 / 9.8 / 10.3); q/k/v 8.2 / 9.1 / 11.8 at s = 7 against 12.4 / 13.8 / 17.0 (v1: 8.9 / 9.6 / 10.5).
// An s that leaves K tile counts one apart measured slower (down s = 9: 21.7 us at M = 8). So: the largest
// divisor s of KT with RG * s resident and at least 4 K tiles per CTA; where that leaves a quarter of the slots
// empty, the largest s at all; where even that does (or RG exceeds the slots: 7B gate/up), the default grid. 0: no
// aligned grid.
static int aligned_splits(int64_t RG, int64_t KT, int64_t cap) {
  if (RG < 1 || RG > cap) return 0;
  const int smax = (int)std::min<int64_t>(cap / RG, KT / 4);
  int s = 0;
  for (int c = smax; c >= 1 && s == 0; --c)
    if (KT % c == 0) s = c;
  if (RG * s * 4 < cap * 3) s = smax;
  return (s >= 1 && RG * s * 4 >= cap * 3) ? s : 0;
}
static int64_t g_last_split = 0;  // the last launch's K split, negative when reduced in a cluster (0: stream-K, v2)

// Variant 3 ("auto", the default) picks the small-M kernel per shape from the H200 measurements in
// benchmarks/results/kernel_*_h200.json: the stream-K v2 kernel (4 or 8 warps per block) for the large weights
// (it streams with fewer instructions per tile but pays a fixed reduction cost that small weights do not
// amortize), one of the two configurations of nvfp4_mma_kernel for the rest (details below).
constexpr int64_t kV2MinWeights = 100000000;
constexpr int64_t kV2MinRows = 5120;  // session 5: v2 also wins on the 32B q/k/v, o and down shapes (N >= 5120)
constexpr int64_t kV2W8MinWeights = 60000000;
constexpr int64_t kV2AlignedMinWeights = 10000000;
// session 6 (benchmarks/results/kernel_s6b_h200.json, with the cluster split-K): v2 with 8 warps per block is
// the fastest at M <= 8 on every weight of >= 6e7 entries (7B gate_up 28.6 vs 31.3 us and down 21.7 vs 24.0 at
// M = 8; 32B gate_up 49.2 vs 53.6, down 31.5 vs 33.3) and at 8 < M <= 16 on the wide ones (gate_up: 38.3 vs 41.7
// on 7B, 66.9 vs 72.4 on 32B); at 8 < M <= 16 the alternative configuration with its splits in a cluster wins
// everything else (7B q/k/v 9.8 vs 16.2, o 9.8 vs 15.4, down 25.6 vs 32.8; 32B o 12.8 vs 17.2, down 36.8 vs 45.3);
// at M <= 8 the default configuration wins the small weights (7B q/k/v 10.1, o 10.3 us at M = 8).
//
// Session 9 (benchmarks/results/ab_variants_*_s9_h200.json: two runs of every variant forced in one process,
// interleaved, M = 1, 8, 16; both agree within 0.5 us on the cases below) changed three rules, on 32B shapes and
// the 7B down at M = 16 (the 7B decode at M = 8 keeps its choices):
//   * at M <= 8, square weights of >= 5120 rows (32B o) take v2w8, not v2: 8.6 / 10.2 us at M = 1 against 10.1,
//     10.2 / 12.4 at M = 8 against 12.6 (wide ones, 32B q/k/v, keep v2: 11.5 against 14.4 at M = 1);
//   * at 8 < M <= 16, every weight of >= 6e7 entries takes v2w8 (since session 7's batched fixup): 7B down 24.7 /
//     24.8 against 26.0 / 26.7 for alt with a cluster split, 32B down 33.5 / 33.7 against 36.6 / 36.9;
//   * at 8 < M <= 16, wide weights of >= 5120 rows below that (32B q/k/v) take the default configuration: 15.8 /
//     16.4 against 21.7 / 21.9 for alt.
static int auto_variant(int64_t M, int64_t N, int64_t K) {
  if (M <= 8) {
    if (N * K >= kV2W8MinWeights) return 4;
    if (N >= kV2MinRows) return N > K ? 2 : 4;
    // session 21: with its row-group-aligned grid, v2w8 beat the v1 kernel at M = 1 and 8 on the 7B q/k/v (8.2 /
    // 9.1 us against 8.9 / 9.6) and o (6.9 / 8.4 against 8.1 / 9.8) shapes on the H100 (at M = 16 v1 stays ahead)
    if (g_v2_aligned && N * K >= kV2AlignedMinWeights) return 4;
    return 0;
  }
  if (M <= 16) {
    if (N * K >= kV2W8MinWeights) return 4;
    return (N >= kV2MinRows && N > K) ? 0 : 1;
  }
  // 16 < M <= 64 (session 12, benchmarks/results/s12b_ab_variants.json, every variant forced in one process at
  // M = 32, 40, 64): the stream-K kernel wins on every weight of >= 6e7 entries. With 8 warps per block on those of
  // >= 1e8 (7B gate/up 48.7 / 69.1 / 79.4 us against 60.6 / 81.1 / 100.5 for default; 32B gate/up 84.0 / 127.2 /
  // 148.2 against 103.7 / 149.0 / 167.5 for the best v1; 32B down 48.4 / 70.7 / 80.3 against 51.0 / 87.4 / 105.2),
  // with 4 below (7B down 34.0 / 42.5 / 52.4 against 36.7 / 45.4 / 57.1; v2w8 35.8 / 46.6 / 58.4). Smaller weights
  // keep the v1 kernel (from M = 33 dequantize + cuBLAS, choose_path).
  if (N * K >= kV2MinWeights) return 4;
  if (N * K >= kV2W8MinWeights) return 2;
  return 0;
}

// Wide weights of >= 1e8 entries (gate/up): above M = 16 their K splits stay in the workspace (session 7,
// benchmarks/results/kernel_s7_h200.json: a cluster split measured slower on both gate_up shapes at M = 32 and 64:
// 64.6 against 52.0 us on 7B, 102.1 against 100.7 on 32B), every other weight may use clusters up to g_cluster_max_m
static bool wide_large(int64_t n, int64_t k) { return n * k >= kV2MinWeights && n > k; }

// whether a launch of M rows on device dev may reduce its K splits in a thread-block cluster
static bool clusters_for(int64_t M, int64_t n, int64_t k, int dev) {
  return g_cluster && M <= g_cluster_max_m && !(M > 16 && wide_large(n, k)) && qerl_pdl::device_supports(dev);
}

// Path of linear_out for bf16 x of M rows (auto): the mma kernel up to the large-M threshold, except for small
// weights from M = 32 on, where dequantize + cuBLAS measured faster on the H200 without clusters (7B q/k/v and
// o at M = 32 and 64: 18-22 us against 26-34; session 5, benchmarks/results/kernel_s5_h200.json). With the K
// splits in clusters (session 7, kernel_s7_h200.json) the mma kernel wins at M = 32 on every small weight (7B q/k/v
// 13.7 against 20.3 us, o 13.2 against 18.5; 32B q/k/v 28.4 against 46.2, o 17.9 against 33.0), so the
// dequantize path starts above the cluster M limit there. Above the large-M threshold: the tiled kernel up to
// g_tc_max_m; then, up to M = kMmaMidMaxM, the mma kernel for weights of more than kDequantMaxWeights entries,
// whose dequantized copy costs more than the mma kernel's second 64-token slice (session 23, part 64, H100, M =
// 128: 7B gate/up 152.4 us against 229.7, down 107.6 against 122.2, 32B gate/up 333.9 against 467.7, down 195.2
// against 241.5; the smaller q/k/v and o lose: 7B q/k/v 45.9 against 24.8, 32B q/k/v 77.1 against 63.9, o 59.2
// against 44.0; at M = 256 every shape loses: benchmarks/results/s23/part64_kernel.json); dequantize + cuBLAS
// otherwise.
constexpr int64_t kDequantMaxWeights = 40000000;
constexpr int64_t kMmaMidMaxM = 128;
int64_t choose_path(int64_t M, int64_t n, int64_t k) {
  if (M > g_large_m_threshold) {
    if (M <= g_tc_max_m) return 2;
    return M <= kMmaMidMaxM && n * k > kDequantMaxWeights ? 0 : 1;
  }
  if (M < 32 || n * k > kDequantMaxWeights) return 0;
  int dev = 0;
  cudaGetDevice(&dev);
  return clusters_for(M, n, k, dev) ? 0 : 1;
}

struct SmallCfg {
  int tg, r, kch;
};

// Resident CTAs per SM of `kern` (`threads` per block) at `smem` bytes of dynamic shared memory on device `dev`,
// cached. A launch above the kernel's dynamic shared-memory limit fails with "invalid argument", so the limit is
// raised to the largest size asked for on that device and never lowered: lowering it to a smaller size asked for
// later (M = 13 after M = 16) broke the next launch at the larger one (found on an H100, session 15).
template <typename Kern>
static int resident_ctas(Kern kern, int threads, size_t smem, int dev) {
  struct PerKernel {
    size_t limit = 48 * 1024;  // the default limit
    std::map<size_t, int> occ;
  };
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, PerKernel> table;
  std::lock_guard<std::mutex> lock(mu);
  PerKernel& e = table[{reinterpret_cast<const void*>(kern), dev}];
  auto it = e.occ.find(smem);
  if (it != e.occ.end()) return it->second;
  if (smem > e.limit) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    e.limit = smem;
  }
  int occ = 1;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kern, threads, smem));
  return e.occ[smem] = std::max(occ, 1);
}

static int num_sms(int dev) {
  static std::mutex mu;
  static std::map<int, int> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  int v = kNumSMsDefault;
  cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev);
  cache[dev] = v;
  return v;
}

// one self-resetting ticket buffer per (device, stream): split-K launches on one stream are serialized
static int* counters_for(const at::Tensor& like, int64_t needed) {
  static std::mutex mu;
  static std::map<std::pair<int, cudaStream_t>, at::Tensor> cache;
  const int dev = like.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(dev).stream();
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(dev, stream);
  auto it = cache.find(key);
  if (it == cache.end() || it->second.numel() < needed) {
    int64_t n = std::max<int64_t>(needed, 4096);
    cache[key] = at::zeros({n}, like.options().dtype(at::kInt));
    it = cache.find(key);
  }
  return it->second.data_ptr<int>();
}

static void check_packed(const at::Tensor& qw, const at::Tensor& gs, int64_t n, int64_t k) {
  TORCH_CHECK(qw.is_cuda() && gs.is_cuda(), "qerl: qweight and global_scale must be CUDA tensors");
  QERL_CHECK(qw.scalar_type() == at::kByte && qw.dim() == 3 && qw.size(2) == kRecordBytes,
             "qerl: qweight must be uint8 [N_pad/16, K_pad/64, 576], got %s", qerl_check::shape(qw.sizes()).c_str());
  TORCH_CHECK(qw.is_contiguous(), "qerl: qweight must be contiguous");
  QERL_CHECK(n > 0 && k > 0 && k % 16 == 0, "qerl: need n > 0 and k a positive multiple of 16, got %lld, %lld",
             (long long)n, (long long)k);
  QERL_CHECK(qw.size(0) == (n + 15) / 16 && qw.size(1) == (k + 63) / 64,
             "qerl: qweight of shape %s does not hold a [%lld, %lld] matrix", qerl_check::shape(qw.sizes()).c_str(),
             (long long)n, (long long)k);
  TORCH_CHECK(gs.scalar_type() == at::kFloat && gs.numel() == 1, "qerl: global_scale must be fp32 [1]");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(qw.data_ptr()) % 16 == 0, "qerl: qweight must be 16-byte aligned");
  TORCH_CHECK(qw.get_device() == gs.get_device(), "qerl: tensors on different devices");
}

void dequantize_out(const at::Tensor& qw, const at::Tensor& gs, int64_t n, int64_t k, at::Tensor& out) {
  check_packed(qw, gs, n, k);
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.dim() == 2 && out.size(0) == n && out.size(1) == k,
              "qerl: dequantize output must be a contiguous [n, k] CUDA tensor");
  c10::cuda::CUDAGuard guard(qw.device());
  const int NT = (int)qw.size(0), KT = (int)qw.size(1);
  dim3 grid((KT + kDqTiles - 1) / kDqTiles, NT);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float* gp = gs.data_ptr<float>();
  switch (out.scalar_type()) {
    case at::kBFloat16:
      nvfp4_dequant_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(
          qw.data_ptr<uint8_t>(), gp, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), (int)n, (int)k, NT, KT);
      break;
    case at::kHalf:
      nvfp4_dequant_kernel<__half><<<grid, 256, 0, stream>>>(
          qw.data_ptr<uint8_t>(), gp, reinterpret_cast<__half*>(out.data_ptr()), (int)n, (int)k, NT, KT);
      break;
    case at::kFloat:
      nvfp4_dequant_kernel<float><<<grid, 256, 0, stream>>>(qw.data_ptr<uint8_t>(), gp, out.data_ptr<float>(),
                                                            (int)n, (int)k, NT, KT);
      break;
    default:
      QERL_CHECK(false, "qerl: dequantize supports bf16, fp16 and fp32 outputs, got %s", c10::toString(out.scalar_type()));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// the packed weights qws[i] ([ns[i], ks[i]] matrices, scales gss[i]) dequantized into consecutive bf16 [ns[i], ks[i]]
// blocks of the flat bf16 out (sum of ns[i] * ks[i] elements), kDqMany weights per launch: the same bits as
// dequantize_out of each
void dequantize_many_out(const std::vector<at::Tensor>& qws, const std::vector<at::Tensor>& gss,
                         const std::vector<int64_t>& ns, const std::vector<int64_t>& ks, at::Tensor& out) {
  QERL_CHECK(qws.size() == gss.size() && qws.size() == ns.size() && qws.size() == ks.size(),
             "qerl: dequantize_many needs as many scales, row and column counts as weights, got %zu, %zu, %zu, %zu",
             qws.size(), gss.size(), ns.size(), ks.size());
  TORCH_CHECK(out.is_cuda() && out.is_contiguous() && out.scalar_type() == at::kBFloat16,
              "qerl: dequantize_many writes a contiguous bf16 CUDA tensor");
  int64_t total = 0;
  for (size_t i = 0; i < qws.size(); ++i) {
    check_packed(qws[i], gss[i], ns[i], ks[i]);
    TORCH_CHECK(qws[i].get_device() == out.get_device(), "qerl: tensors on different devices");
    total += ns[i] * ks[i];
  }
  QERL_CHECK(out.numel() == total, "qerl: dequantize_many needs an output of %lld elements, got %lld",
             (long long)total, (long long)out.numel());
  if (qws.empty()) return;
  c10::cuda::CUDAGuard guard(out.device());
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto* base = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
  int64_t at = 0;
  for (size_t i0 = 0; i0 < qws.size(); i0 += kDqMany) {
    DqMany d{};
    int64_t blocks = 0;
    d.count = (int)std::min<size_t>(kDqMany, qws.size() - i0);
    for (int e = 0; e < d.count; ++e) {
      const size_t i = i0 + e;
      const int NT = (int)qws[i].size(0), KT = (int)qws[i].size(1);
      d.qw[e] = qws[i].data_ptr<uint8_t>();
      d.gs[e] = gss[i].data_ptr<float>();
      d.out[e] = base + at;
      d.n[e] = (int)ns[i], d.k[e] = (int)ks[i], d.kt[e] = KT, d.kch[e] = (KT + kDqTiles - 1) / kDqTiles;
      d.start[e] = (int)blocks;
      blocks += (int64_t)NT * d.kch[e];
      at += ns[i] * ks[i];
    }
    QERL_CHECK(blocks < (int64_t)1 << 31, "qerl: dequantize_many: %lld blocks in one launch", (long long)blocks);
    nvfp4_dequant_many_kernel<<<(unsigned)blocks, 256, 0, stream>>>(d);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <int TG, int R, int D, int KCH, int NACC, int MINB>
static void launch_mma(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& gs, const __nv_bfloat16* bias,
                       at::Tensor& out, int M, int N, int K, int NT, int KT, const LoraAug& la) {
  constexpr int ROWS_BLOCKS = kWarps * R;
  constexpr int MP = 8 * TG;
  TORCH_CHECK(la.h == nullptr || TG <= kLoraAugMaxTG, "qerl: a LoRA term reached a kernel instance without one");
  TORCH_CHECK(la.h == nullptr || (la.h_bf16 != 0) == (TG > kLoraAugFp32MaxTG),
              "qerl: a LoRA term's hs dtype is not the one this kernel instance reads");
  const int RG = (NT + ROWS_BLOCKS - 1) / ROWS_BLOCKS;
  const int slices = (M + kSliceTokens - 1) / kSliceTokens;
  const int sms = num_sms(x.get_device());
  const int rows_alloc = std::min(MP, std::min(M, kSliceTokens) + 1);
  const size_t smem = (size_t)2 * rows_alloc * (KCH * 64 + 8) * sizeof(__nv_bfloat16);
  auto kern = nvfp4_mma_kernel<TG, R, D, KCH, NACC, MINB>;
  const int occ = resident_ctas(kern, kWarps * 32, smem, x.get_device());
  // K split: an SM streams at full speed only with all its `occ` CTA slots busy (latency-bound below), so
  // the time is ~ (tiles per CTA + prologue) x max(CTAs on the busiest SM, occ); plus the split-K partials
  // (written and read once, mostly through L2)
  // With clusters (sm_90+, set_cluster), a split of S <= 8 may instead reduce through distributed shared
  // memory: no workspace traffic, tickets or fences (a smaller reduction term), S capped at the portable cluster
  // size. Both ways are costed; the cheaper one runs.
  // Measured (session 6): at M <= 8 the costs below pick well between the two; at 8 < M <= 16 the workspace
  // partials cost more than modelled and a cluster split wins whenever one is possible. Session 7: the same holds
  // at 16 < M <= 32 except on wide weights (clusters_for); at M = 64 clusters won on some shapes and lost on others,
  // so they stop at M = 32 (set_cluster_max_m / QERL_CLUSTER_MAX_M move the limit).
  const bool clusters = clusters_for(M, N, K, x.get_device());
  const bool clusters_only = clusters && M > 8 && KT >= 2;
  const int sat = occ;
  int best_s = 1;
  bool best_cl = false;
  double best = 1e300;
  const int max_s = std::max(1, std::min(64, KT / 2));
  for (int s = 1; s <= max_s; ++s) {
    const int tps = (KT + s - 1) / s;
    const int s_eff = (KT + tps - 1) / tps;
    if (s_eff != s) continue;
    const double ctas = (double)RG * slices * s;
    const double load = std::ceil(ctas / sms);
    const double stream = (tps + 3.0) * std::max(load, (double)sat) * ROWS_BLOCKS * kRecordBytes / sat;
    const double partials = s > 1 ? (double)s * M * N * 8.0 / sms : 0.0;
    for (int c = 0; c < 2; ++c) {
      if (c == 1 && !(clusters && s > 1 && s <= kMaxClusterSplit)) continue;
      if (c == 0 && clusters_only) continue;
      const double cost = stream + (c ? 0.1 : 0.35) * partials;
      if (cost < best * 0.99) {
        best = cost;
        best_s = s;
        best_cl = c == 1;
      }
    }
  }
  if (g_split_override > 0) {  // tests and benchmarks: a fixed split (the nearest one that leaves no split empty),
    // through a cluster whenever clusters are on
    best_cl = clusters;
    const int want = std::max(1, std::min<int>((int)g_split_override, clusters ? std::min(KT, kMaxClusterSplit) : KT));
    best_s = (KT + ((KT + want - 1) / want) - 1) / ((KT + want - 1) / want);
  }
  const int S = best_s;
  const int tps = (KT + S - 1) / S;
  const int cl = (best_cl && S > 1) ? 1 : 0;
  float* ws = nullptr;
  int* counters = nullptr;
  at::Tensor wsbuf;
  if (S > 1 && !cl) {
    wsbuf = at::empty({(int64_t)S * M * N}, x.options().dtype(at::kFloat));
    ws = wsbuf.data_ptr<float>();
    counters = counters_for(x, (int64_t)RG * slices);
  }
  dim3 grid(slices, RG, S);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(qerl_pdl::launch_clustered(kern, grid, dim3(kWarps * 32), smem, stream, x.get_device(),
                                             cl ? (unsigned)S : 1u,
                                             reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
                                             qw.data_ptr<uint8_t>(), gs.data_ptr<float>(), bias,
                                             reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), ws, counters, M, N, K,
                                             NT, KT, S, tps, cl, la));
  g_last_split = S * (cl ? -1 : 1);
}

// whether `clusters` clusters of s CTAs of kern (threads, smem) are resident at once on device dev (cached per
// kernel, size, shared memory and device; a failed query: no)
template <typename Kern>
static bool v2_clusters_fit(Kern kern, int threads, size_t smem, int s, int64_t clusters, int dev) {
  static std::mutex mu;
  static std::map<std::tuple<const void*, int, size_t, int>, int> table;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kern), s, smem, dev);
  auto it = table.find(key);
  if (it == table.end()) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)s, 1, 1);
    cfg.blockDim = dim3((unsigned)threads);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr;
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = (unsigned)s;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int v = 0;
    if (cudaOccupancyMaxActiveClusters(&v, kern, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // (the query's own error: no clusters for this configuration)
      v = 0;
    }
    it = table.emplace(key, v).first;
  }
  return it->second >= clusters;
}

// opt-in variant 2 (stream-K, fewer instructions per tile); M <= 8 * TG; PAIR: linear_silu_out's pair mode
template <int TG, int R, int D, int KCH, int NACC, int MINB, int NW, bool PAIR = false>
static void launch_mma_v2(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& gs,
                          const __nv_bfloat16* bias, at::Tensor& out, int M, int N, int K, int NT, int KT,
                          const LoraAug& la) {
  constexpr int ROWS_BLOCKS = NW * R;
  constexpr int MP = 8 * TG;
  QERL_CHECK(M <= MP, "qerl: v2 kernel instance for M <= %d called with M = %d", MP, M);
  TORCH_CHECK(la.h == nullptr || TG <= kLoraAugMaxTG, "qerl: a LoRA term reached a kernel instance without one");
  TORCH_CHECK(la.h == nullptr || (la.h_bf16 != 0) == (TG > kLoraAugFp32MaxTG),
              "qerl: a LoRA term's hs dtype is not the one this kernel instance reads");
  const int RG = (NT + ROWS_BLOCKS - 1) / ROWS_BLOCKS;
  const int sms = num_sms(x.get_device());
  const int rows_alloc = std::min(MP, M + 1);
  const size_t smem = (size_t)2 * rows_alloc * (KCH * 64 + 8) * sizeof(__nv_bfloat16);
  auto kern = nvfp4_mma_v2_kernel<TG, R, D, KCH, NACC, MINB, NW, PAIR>;
  const int occ = resident_ctas(kern, NW * 32, smem, x.get_device());
  // every resident CTA slot gets an equal share of the RG * KT units, but at least kMinUnits of them (small
  // problems: fewer, longer CTAs instead of many that are all prologue)
  constexpr int64_t kMinUnits = 2 * KCH;
  const int64_t W = (int64_t)RG * KT;
  int64_t P = std::max<int64_t>(1, std::min<int64_t>((int64_t)sms * occ, (W + kMinUnits - 1) / kMinUnits));
  int sa = 0;  // the aligned grid's splits per row group (0: not aligned)
  if (TG <= 2 && g_v2_aligned) {  // M <= 16: where the sweep measured it
    sa = aligned_splits(RG, KT, (int64_t)sms * occ);
    if (sa > 0) P = (int64_t)RG * sa;
  }
  if (g_v2_grid > 0 && g_v2_grid != P) {
    P = std::min<int64_t>(g_v2_grid, W);
    sa = 0;
  }
  g_last_v2_grid = P;
  g_last_v2_cluster = 0;
  at::Tensor wsbuf = at::empty({2 * P * (int64_t)M * ROWS_BLOCKS * 16}, x.options().dtype(at::kFloat));
  int* counters = counters_for(x, RG);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  g_last_split = 0;
  // an aligned grid's s CTAs of a row group are consecutive: as one cluster they add their partials through
  // distributed shared memory (cluster_reduce: the same order, the same bits as the workspace), where every
  // cluster of s fits on the device at once. Instances of their own (CL), for 8 warps at M <= 16 only: inline in
  // the other instances the cluster path raised the K loop's registers into spills. Session 21 on the H100
  // (benchmarks/results/s21/part52_*): 7B o 7.0 / 8.6 / 10.7 us -> 6.7 / 7.3 / 10.7 at M = 1 / 8 / 16, down
  // 18.3 / 19.7 / 23.1 -> 18.1 / 19.1 / 21.1; q/k/v's 36 clusters of 7 do not all fit (the workspace stays)
  if constexpr (!PAIR && NW == 8 && TG <= 2) {
    auto ckern = nvfp4_mma_v2_kernel<TG, R, D, KCH, NACC, MINB, NW, false, true>;
    if (g_v2_cluster && sa >= 2 && sa <= kMaxClusterSplit && qerl_pdl::device_supports(x.get_device()) &&
        resident_ctas(ckern, NW * 32, smem, x.get_device()) == occ &&
        v2_clusters_fit(ckern, NW * 32, smem, sa, RG, x.get_device())) {
      g_last_v2_cluster = sa;
      C10_CUDA_CHECK(qerl_pdl::launch_cluster_dims(
          ckern, dim3((unsigned)P), dim3(NW * 32), smem, stream, x.get_device(), dim3((unsigned)sa, 1, 1),
          reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), qw.data_ptr<uint8_t>(), gs.data_ptr<float>(), bias,
          reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), wsbuf.data_ptr<float>(), counters, M, N, K, NT, KT, RG,
          v2_flags(M), la));
      return;
    }
  }
  C10_CUDA_CHECK(qerl_pdl::launch(kern, dim3((unsigned)P), dim3(NW * 32), smem, stream, x.get_device(),
                                   reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), qw.data_ptr<uint8_t>(),
                                   gs.data_ptr<float>(), bias, reinterpret_cast<__nv_bfloat16*>(out.data_ptr()),
                                   wsbuf.data_ptr<float>(), counters, M, N, K, NT, KT, RG, v2_flags(M), la));
}

// the small-M kernel linear_out runs for bf16 x of M rows on the mma path: 0 / 1 the two configurations of
// nvfp4_mma_kernel, 2 / 4 the stream-K kernel with 4 / 8 warps per block (M <= 64; larger M as 0)
// Wide weights whose 128-row groups outnumber the resident CTA slots get no aligned grid with 8 warps per CTA
// (7B gate/up: 296 row groups, 264 slots on 132 SMs); with 10 warps (160-row groups: 237) they do. Session 21 on
// the H100 (benchmarks/results/s21/part49_partition_h100.log), 7B gate/up at M = 1 / 8 / 16: 30.3 / 31.7 / 34.4 us
// against 33.1 / 34.5 / 38.0 for v2w8 (stream-K grid). Down keeps v2w8 (its aligned 224-CTA grid: 18.3 / 19.5 /
// 23.1 us against 18.7 / 21.0 / 26.8 for the best 10-warp grid). Only while aligned grids are on, M <= 16.
template <int TG>
static int aligned_warps(int64_t M, int64_t n, int64_t k) {  // 8 or 10 (the first whose row groups align), 0: none
  if (!g_v2_aligned || M > 8 * TG) return 0;
  const int dev = c10::cuda::current_device();
  const int64_t NT = (n + 15) / 16, KT = (k + 63) / 64;
  const size_t smem = (size_t)2 * std::min<int64_t>(8 * TG, M + 1) * (8 * 64 + 8) * sizeof(__nv_bfloat16);
  const int64_t cap8 = (int64_t)num_sms(dev) *
                       resident_ctas(nvfp4_mma_v2_kernel<TG, 1, 4, 8, 2, 2, 8>, 8 * 32, smem, dev);
  if (aligned_splits((NT + 7) / 8, KT, cap8) > 0) return 8;
  const int64_t cap10 = (int64_t)num_sms(dev) *
                        resident_ctas(nvfp4_mma_v2_kernel<TG, 1, 4, 8, 2, 2, 10>, 10 * 32, smem, dev);
  return aligned_splits((NT + 9) / 10, KT, cap10) > 0 ? 10 : 0;
}

// whether a v2w8 launch of M <= 8 * TG rows of an n x k weight on this device gets an aligned grid whose split-K
// sums run in thread-block clusters (launch_mma_v2's conditions for its CL instance)
template <int TG>
static bool aligned_w8_clusters(int64_t M, int64_t n, int64_t k) {
  if (!g_v2_aligned || !g_v2_cluster || M > 8 * TG) return false;
  const int dev = c10::cuda::current_device();
  if (!qerl_pdl::device_supports(dev)) return false;
  const int64_t NT = (n + 15) / 16, KT = (k + 63) / 64, RG = (NT + 7) / 8;
  const size_t smem = (size_t)2 * std::min<int64_t>(8 * TG, M + 1) * (8 * 64 + 8) * sizeof(__nv_bfloat16);
  auto kern = nvfp4_mma_v2_kernel<TG, 1, 4, 8, 2, 2, 8>;
  auto ckern = nvfp4_mma_v2_kernel<TG, 1, 4, 8, 2, 2, 8, false, true>;
  const int occ = resident_ctas(kern, 8 * 32, smem, dev);
  const int sa = aligned_splits(RG, KT, (int64_t)num_sms(dev) * occ);
  return sa >= 2 && sa <= kMaxClusterSplit && resident_ctas(ckern, 8 * 32, smem, dev) == occ &&
         v2_clusters_fit(ckern, 8 * 32, smem, sa, RG, dev);
}

// auto_variant refined on the device (SM count and occupancy): v2w10 where only its row groups align; the
// q/k/v- and o-sized weights that auto_variant gives v2w8 for its aligned grid (M <= 8) keep the v1 kernel where
// no such grid forms.
// Session 22 on the H100 (benchmarks/results/s22/part54_kernel_h100.json, every variant in one run): every weight
// of >= 1e7 entries whose v2w8 grid aligns is fastest with v2w8 at M <= 8, and at 8 < M <= 16 where that grid's
// sums run in clusters: 32B q/k/v 11.9 / 12.3 us at M = 1 / 8 against 14.1 / 15.1 for v2, 14.5 at M = 16 against
// 18.0 for default; 32B o 12.8 at M = 16 against 14.0 for alt; 7B o 8.6 at M = 16 against 10.5. The 7B q/k/v's
// clusters of 7 do not fit, and at M = 16 its workspace sums lose to alt (11.7 against 10.4 us): it keeps alt.
static int auto_choice(int64_t M, int64_t n, int64_t k) {
  const int v = auto_variant(M, n, k);
  if (M > 16) return v;
  if (v != 4) {
    const bool w8 = g_v2_aligned && n * k >= kV2AlignedMinWeights &&
                    (M <= 8 ? aligned_warps<1>(M, n, k) == 8 : aligned_w8_clusters<2>(M, n, k));
    return w8 ? 4 : v;
  }
  const int w = M <= 8 ? aligned_warps<1>(M, n, k) : aligned_warps<2>(M, n, k);
  if (w == 10) return 5;
  if (w == 0 && M <= 8 && n * k < kV2W8MinWeights && n < kV2MinRows) return 0;
  return 4;
}

static int resolved_variant(int64_t M, int64_t n, int64_t k) {
  const int v = g_variant == 3 ? auto_choice(M, n, k) : g_variant;
  if ((v == 2 || v == 4) && M <= kSliceTokens) return v;
  if (v == 5 && M <= kSliceTokens) return M <= 16 ? 5 : 4;  // (10 warps: instances for M <= 16 only)
  return v == 1 ? 1 : 0;
}

// the mma path for x already contiguous and 16-byte aligned; la: a LoRA term (la.h null: none)
static void run_mma(const at::Tensor& xc, const at::Tensor& qw, const at::Tensor& gs, const __nv_bfloat16* bp,
                    at::Tensor& out, int64_t n, int64_t k, int variant, const LoraAug& la) {
  const int Mi = (int)xc.size(0), N = (int)n, K = (int)k, NT = (int)qw.size(0), KT = (int)qw.size(1);
  TORCH_CHECK(xc.size(0) <= (int64_t)65535 * kSliceTokens, "qerl: M too large for the mma path");
  if (variant == 2) {
    if (Mi <= 8) launch_mma_v2<1, 1, 4, 8, 2, 5, 4>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else if (Mi <= 16) launch_mma_v2<2, 1, 4, 8, 2, 4, 4>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else if (Mi <= 32) launch_mma_v2<4, 1, 4, 8, 1, 3, 4>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else launch_mma_v2<8, 1, 2, 4, 1, 3, 4>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
  } else if (variant == 5) {  // v2 with 10 warps per block (160 rows): M <= 16 (resolved_variant)
    if (Mi <= 8) launch_mma_v2<1, 1, 4, 8, 2, 2, 10>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else launch_mma_v2<2, 1, 4, 8, 2, 2, 10>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
  } else if (variant == 4) {  // v2 with 8 warps per block: the staged activations serve 128 rows
    if (Mi <= 8) launch_mma_v2<1, 1, 4, 8, 2, 2, 8>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else if (Mi <= 16) launch_mma_v2<2, 1, 4, 8, 2, 2, 8>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else if (Mi <= 32) launch_mma_v2<4, 1, 4, 8, 1, 2, 8>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else launch_mma_v2<8, 1, 2, 4, 1, 2, 8>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
  } else if (Mi <= 8) {
    if (variant == 1) launch_mma<1, 1, 4, 8, 2, 7>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else launch_mma<1, 1, 6, 12, 2, 6>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
  } else if (Mi <= 16) {
    if (variant == 1) launch_mma<2, 2, 4, 8, 1, 3>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else launch_mma<2, 1, 8, 16, 2, 3>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
  } else if (Mi <= 32) {  // variant 1 here: four row blocks per warp (activations staged once per 256 rows)
    if (variant == 1) launch_mma<4, 4, 2, 4, 1, 2>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else launch_mma<4, 2, 4, 8, 1, 3>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
  } else {  // variant 1 here: two row blocks per warp
    if (variant == 1) launch_mma<8, 2, 2, 4, 1, 2>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
    else launch_mma<8, 1, 2, 4, 1, 3>(xc, qw, gs, bp, out, Mi, N, K, NT, KT, la);
  }
}

// ---- the tiled tensor-core path (path 2) ----

// One launch of a tiled kernel (tile: `row_blocks` 16-row blocks x `tokens` tokens, `threads` per CTA, `smem`
// bytes of dynamic shared memory); `cfg` is recorded for the tests.
template <typename Kern>
static void launch_tiled(Kern kern, int threads, int smem, int row_blocks, int tokens, const at::Tensor& x,
                         const at::Tensor& qw, const at::Tensor& gs, const __nv_bfloat16* bias, at::Tensor& out, int M,
                         int N, int K, int NT, int KT, int cfg) {
  const int dev = x.get_device();
  const int occ = resident_ctas(kern, threads, (size_t)smem, dev);
  const int64_t slots = (int64_t)num_sms(dev) * occ;
  const int RT = (NT + row_blocks - 1) / row_blocks;
  const int MT = (M + tokens - 1) / tokens;
  const int64_t tiles = (int64_t)RT * MT;
  // K split: waves of CTAs x (K tiles per CTA + pipeline fill), plus the fp32 partials (a CTA writes its tile's
  // partial, about two K tiles of traffic; the last one reads all S); at least 4 K tiles per split
  int S = 1;
  double best = 1e300;
  for (int s = 1; s <= std::max(1, std::min(32, KT / 4)); ++s) {
    const int tps = (KT + s - 1) / s;
    if ((KT + tps - 1) / tps != s) continue;
    const double waves = std::ceil((double)(tiles * s) / (double)slots);
    const double cost = waves * (tps + 2.0) + (s > 1 ? 2.0 + s : 0.0);
    if (cost < best * 0.99) {
      best = cost;
      S = s;
    }
  }
  if (g_tc_split > 0) {
    const int want = (int)std::min<int64_t>(g_tc_split, KT);
    const int tps = (KT + want - 1) / want;
    S = (KT + tps - 1) / tps;
  }
  const int tps = (KT + S - 1) / S;
  float* ws = nullptr;
  int* counters = nullptr;
  at::Tensor wsbuf;
  if (S > 1) {
    wsbuf = at::empty({(int64_t)S * M * N}, x.options().dtype(at::kFloat));
    ws = wsbuf.data_ptr<float>();
    counters = counters_for(x, tiles);
  }
  const int vec_out = N % 8 == 0 && reinterpret_cast<uintptr_t>(out.data_ptr()) % 16 == 0;
  dim3 grid(RT, MT, S);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(qerl_pdl::launch_clustered(kern, grid, dim3(threads), (size_t)smem, stream, dev, 1u,
                                             reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
                                             qw.data_ptr<uint8_t>(), gs.data_ptr<float>(), bias,
                                             reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), ws, counters, M, N, K,
                                             NT, KT, S, tps, vec_out));
  g_last_tc = (int64_t)cfg * 1000 + S;
}

template <int WR, int WT, int R, int TG, int MINB>
static void launch_tc(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& gs, const __nv_bfloat16* bias,
                      at::Tensor& out, int M, int N, int K, int NT, int KT, int cfg) {
  using C = TcCfg<WR, WT, R, TG>;
  launch_tiled(nvfp4_tc_kernel<WR, WT, R, TG, MINB>, C::kThreads, C::kSmem, C::kRowBlocks, C::kTokens, x, qw, gs,
               bias, out, M, N, K, NT, KT, cfg);
}

template <int WG, int NTOK, int MINB>
static void launch_wg(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& gs, const __nv_bfloat16* bias,
                      at::Tensor& out, int M, int N, int K, int NT, int KT, int cfg) {
  using C = WgCfg<WG, NTOK>;
  launch_tiled(nvfp4_wg_kernel<WG, NTOK, MINB>, C::kThreads, C::kSmem, C::kRowBlocks, C::kTokens, x, qw, gs, bias,
               out, M, N, K, NT, KT, cfg);
}

// whether the wgmma kernel runs on device `dev`: a cc 9.0 device and a build with sm_90a code (kernel.py defines
// QERL_HAS_SM90A when its arch flags name sm_90a; a cc 9.0 device runs that cubin)
static bool wgmma_available(int dev) {
#ifdef QERL_HAS_SM90A
  static std::mutex mu;
  static std::map<int, bool> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(dev);
  if (it != cache.end()) return it->second;
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev));
  return cache[dev] = major == 9 && minor == 0;
#else
  (void)dev;
  return false;
#endif
}

// tiled configurations: 1-3 mma.sync (nvfp4_tc_kernel), 4-7 wgmma (nvfp4_wg_kernel, sm_90a only)
constexpr int kTcCfgs = 7;
static int tc_auto_cfg(int64_t M, int dev) {
  if (wgmma_available(dev)) return M <= 64 ? 6 : 4;
  return M <= 64 ? 3 : 1;
}

static void run_tc(const at::Tensor& xc, const at::Tensor& qw, const at::Tensor& gs, const __nv_bfloat16* bp,
                   at::Tensor& out, int64_t n, int64_t k) {
  const int M = (int)xc.size(0), N = (int)n, K = (int)k, NT = (int)qw.size(0), KT = (int)qw.size(1);
  const int dev = xc.get_device();
  const int cfg = g_tc_cfg ? g_tc_cfg : tc_auto_cfg(M, dev);
  QERL_CHECK(cfg < 4 || wgmma_available(dev),
             "qerl: tiled configuration %d needs the wgmma kernel, which this build has for sm_90a devices only", cfg);
  switch (cfg) {
    case 1: launch_tc<4, 2, 2, 8, 1>(xc, qw, gs, bp, out, M, N, K, NT, KT, cfg); break;
    case 2: launch_tc<4, 2, 2, 4, 2>(xc, qw, gs, bp, out, M, N, K, NT, KT, cfg); break;
    case 3: launch_tc<4, 1, 2, 8, 2>(xc, qw, gs, bp, out, M, N, K, NT, KT, cfg); break;
    case 4: launch_wg<2, 128, 1>(xc, qw, gs, bp, out, M, N, K, NT, KT, cfg); break;
    case 5: launch_wg<4, 128, 1>(xc, qw, gs, bp, out, M, N, K, NT, KT, cfg); break;
    case 6: launch_wg<2, 64, 2>(xc, qw, gs, bp, out, M, N, K, NT, KT, cfg); break;
    default: launch_wg<1, 128, 2>(xc, qw, gs, bp, out, M, N, K, NT, KT, cfg); break;
  }
}

static void check_linear_args(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& gs, int64_t n, int64_t k,
                              const at::Tensor& out, const c10::optional<at::Tensor>& bias) {
  check_packed(qw, gs, n, k);
  TORCH_CHECK(x.is_cuda() && x.get_device() == qw.get_device(), "qerl: x must be on the weight's device");
  QERL_CHECK(x.dim() == 2 && x.size(1) == k, "qerl: x must be [M, %lld], got %s", (long long)k,
             qerl_check::shape(x.sizes()).c_str());
  TORCH_CHECK(out.is_cuda() && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n &&
                  out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "qerl: out must be a contiguous [M, n] tensor of x's dtype");
  if (bias.has_value())
    TORCH_CHECK(bias->is_cuda() && bias->get_device() == x.get_device() && bias->scalar_type() == x.scalar_type() &&
                    bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous(),
                "qerl: bias must be a contiguous [n] tensor of x's dtype on x's device");
}

static at::Tensor aligned_contiguous(const at::Tensor& x) {
  at::Tensor xc = x.contiguous();
  if (reinterpret_cast<uintptr_t>(xc.data_ptr()) % 16 != 0) xc = xc.clone();
  return xc;
}

// x [M, K] bf16 contiguous -> out [M, N] bf16 contiguous (+ bias [N] of x's dtype, added after the bf16
// rounding of the product, as `y + bias` would). path: -1 auto, 0 mma kernel, 1 dequantize + cuBLAS, 2 the tiled
// tensor-core kernel.
// Returns the path taken.
int64_t linear_out(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& gs, int64_t n, int64_t k,
                   at::Tensor& out, int64_t path, const c10::optional<at::Tensor>& bias) {
  check_linear_args(x, qw, gs, n, k, out, bias);
  c10::cuda::CUDAGuard guard(qw.device());
  const int64_t M = x.size(0);
  if (M == 0) return 0;
  if (path < 0) path = x.scalar_type() == at::kBFloat16 ? choose_path(M, n, k) : 1;
  if (path == 2 && x.scalar_type() == at::kBFloat16) {
    const __nv_bfloat16* bp = bias.has_value() ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
    run_tc(aligned_contiguous(x), qw, gs, bp, out, n, k);
    return 2;
  }
  if (path != 0 || x.scalar_type() != at::kBFloat16) {
    at::Tensor w = at::empty({n, k}, x.options());
    dequantize_out(qw, gs, n, k, w);
    at::mm_out(out, x, w.t());
    if (bias.has_value()) out.add_(*bias);
    return 1;
  }
  const __nv_bfloat16* bp = bias.has_value() ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
  run_mma(aligned_contiguous(x), qw, gs, bp, out, n, k, resolved_variant(M, n, k), LoraAug{});
  return 0;
}

// the LoRA term of a small-M launch of M rows of an n-row weight (see linear_lora_out) into la; hk: the hs the kernel
// reads (hs itself, or a converted / aligned copy). False where the kernels do not take the term.
static bool lora_aug_for(int64_t M, int64_t n, const at::Tensor& x, const at::Tensor& hs, const at::Tensor& bs,
                         const std::vector<int64_t>& segs, LoraAug& la, at::Tensor& hk) {
  if (!hs.is_cuda() || !(hs.scalar_type() == at::kBFloat16 || hs.scalar_type() == at::kFloat) ||
      !hs.is_contiguous() || hs.dim() != 2 || hs.size(0) != M || hs.get_device() != x.get_device())
    return false;
  const int64_t R = hs.size(1);
  if (!bs.is_cuda() || bs.scalar_type() != at::kBFloat16 || !bs.is_contiguous() || bs.dim() != 2 || bs.size(0) != R ||
      bs.size(1) != n || bs.get_device() != x.get_device() || R < 1 || R % 2 != 0)
    return false;
  la.R = (int)R;
  if (segs.empty()) {
    if (R % 16 != 0) return false;
    la.nseg = 1;
    la.col_end[0] = (int)n;
    la.rend[0] = (int)R;
  } else {
    if (segs.size() % 3 != 0 || segs.size() / 3 > (size_t)kLoraAugSegs) return false;
    la.nseg = (int)(segs.size() / 3);
    int64_t prev = 0;
    for (int i = 0; i < la.nseg; ++i) {
      const int64_t ce = segs[3 * i], rb = segs[3 * i + 1], re = segs[3 * i + 2];
      // a 16-row block lies in one member (ce % 16; the last may end at n), whole k16 steps of its rank rows
      const bool end_ok = ce % 16 == 0 || (i == la.nseg - 1 && ce == n);
      if (ce <= prev || !end_ok || rb < 0 || rb > re || re > R || (re - rb) % 16 != 0 || rb % 2 != 0) return false;
      la.col_end[i] = (int)ce;
      la.rbeg[i] = (int)rb;
      la.rend[i] = (int)re;
      prev = ce;
    }
    if (prev != n) return false;
  }
  // the instance's hs dtype (kLoraAugFp32MaxTG; exact either way, as hs holds bf16 values); fresh tensors are
  // aligned for the kernel's 8-byte (fp32 pair) and 4-byte (bf16 pair) loads
  const bool want_bf16 = M > 8 * kLoraAugFp32MaxTG;
  hk = hs.to(want_bf16 ? at::kBFloat16 : at::kFloat);  // (hs itself where it already is)
  if (reinterpret_cast<uintptr_t>(hk.data_ptr()) % (2 * hk.element_size()) != 0) hk = hk.clone();
  la.h = hk.data_ptr();
  la.h_bf16 = want_bf16 ? 1 : 0;
  la.b = reinterpret_cast<const __nv_bfloat16*>(bs.data_ptr());
  return true;
}

// out = silu(x @ Wg^T) * (x @ Wu^T) for a fused gate/up weight qw of n rows (gate rows [0, n/2), up rows [n/2, n)):
// x [M, k] bf16 contiguous, out [M, n/2] bf16 contiguous, in one launch of the stream-K kernel in pair mode
// (8 warps per block): the product rounded to bf16 followed by qerl_fused's silu_mul, bit for bit where the
// stream-K split is that of the block-interleaved weight (gate block j, up block j, ...) — against the plain
// weight's product the rows cut between CTAs are cut elsewhere, so fp32 sums differ in order there. Returns false,
// launching nothing, where that kernel does not take it (M outside 1..64, x not bf16, n not a multiple of 32 or
// the weight padded past n rows). hs, bs, segs (both or neither): a LoRA term as linear_lora_out takes it, bs's
// columns in the weight's row order (gate rows first); the kernel adds each physical row's term in fp32 before
// the SiLU (session 22).
bool linear_silu_out(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& gs, int64_t n, int64_t k,
                     at::Tensor& out, const c10::optional<at::Tensor>& hs, const c10::optional<at::Tensor>& bs,
                     const std::vector<int64_t>& segs) {
  check_packed(qw, gs, n, k);
  TORCH_CHECK(x.is_cuda() && x.get_device() == qw.get_device(), "qerl: x must be on the weight's device");
  QERL_CHECK(x.dim() == 2 && x.size(1) == k, "qerl: x must be [M, %lld], got %s", (long long)k,
             qerl_check::shape(x.sizes()).c_str());
  TORCH_CHECK(out.is_cuda() && out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == n / 2 &&
                  out.is_contiguous() && out.scalar_type() == x.scalar_type(),
              "qerl: out must be a contiguous [M, n / 2] tensor of x's dtype");
  const int64_t M = x.size(0);
  if (M < 1 || M > kSliceTokens || x.scalar_type() != at::kBFloat16 || n % 32 != 0 || qw.size(0) * 16 != n)
    return false;
  if (hs.has_value() != bs.has_value()) return false;
  c10::cuda::CUDAGuard guard(qw.device());
  LoraAug la{};
  at::Tensor hk;  // (keeps the term's hs alive through the launch)
  if (hs.has_value() && (M > 8 * kLoraAugMaxTG || !lora_aug_for(M, n, x, *hs, *bs, segs, la, hk))) return false;
  const at::Tensor xc = aligned_contiguous(x);
  const int Mi = (int)M, N = (int)n, K = (int)k, NT = (int)qw.size(0), KT = (int)qw.size(1);
  // the warps per block linear_out would run for this weight: 10 where it resolves to that variant, else 8
  const bool w10 = resolved_variant(M, n, k) == 5;
  if (Mi <= 8 && w10) launch_mma_v2<1, 1, 4, 8, 2, 2, 10, true>(xc, qw, gs, nullptr, out, Mi, N, K, NT, KT, la);
  else if (Mi <= 16 && w10) launch_mma_v2<2, 1, 4, 8, 2, 2, 10, true>(xc, qw, gs, nullptr, out, Mi, N, K, NT, KT, la);
  else if (Mi <= 8) launch_mma_v2<1, 1, 4, 8, 2, 2, 8, true>(xc, qw, gs, nullptr, out, Mi, N, K, NT, KT, la);
  else if (Mi <= 16) launch_mma_v2<2, 1, 4, 8, 2, 2, 8, true>(xc, qw, gs, nullptr, out, Mi, N, K, NT, KT, la);
  else if (Mi <= 32) launch_mma_v2<4, 1, 4, 8, 1, 2, 8, true>(xc, qw, gs, nullptr, out, Mi, N, K, NT, KT, la);
  else launch_mma_v2<8, 1, 2, 4, 1, 2, 8, true>(xc, qw, gs, nullptr, out, Mi, N, K, NT, KT, la);
  return true;
}

// out = x @ W^T (+ bias) + hs @ bs in one launch of the small-M kernel (see LoraAug): x [M, k] bf16, hs [M, R] fp32
// (bf16 values) or bf16, bs [R, n] bf16, both contiguous; segs: flat (col_end, row_begin, row_end) triples as in
// qerl_fused's lora_add (empty: every rank row for every column). Returns false, launching nothing, where no
// small-M kernel would run the product (the dequantize path) or the term's shapes are outside what it takes (more
// than 64 rows, members not 16-row aligned, rank ranges not multiples of 16, more than 8 members): the caller
// then adds the term itself.
bool linear_lora_out(const at::Tensor& x, const at::Tensor& qw, const at::Tensor& gs, int64_t n, int64_t k,
                     at::Tensor& out, const c10::optional<at::Tensor>& bias, const at::Tensor& hs, const at::Tensor& bs,
                     const std::vector<int64_t>& segs) {
  check_linear_args(x, qw, gs, n, k, out, bias);
  const int64_t M = x.size(0);
  if (M < 1 || M > 8 * kLoraAugMaxTG || x.scalar_type() != at::kBFloat16) return false;
  c10::cuda::CUDAGuard guard(qw.device());
  if (choose_path(M, n, k) != 0) return false;
  LoraAug la{};
  at::Tensor hk;
  if (!lora_aug_for(M, n, x, hs, bs, segs, la, hk)) return false;
  const __nv_bfloat16* bp = bias.has_value() ? reinterpret_cast<const __nv_bfloat16*>(bias->data_ptr()) : nullptr;
  run_mma(aligned_contiguous(x), qw, gs, bp, out, n, k, resolved_variant(M, n, k), la);
  return true;
}

// g [M, N] -> out [M, K] = g @ W (dequantize + cuBLAS)
void linear_t_out(const at::Tensor& g, const at::Tensor& qw, const at::Tensor& gs, int64_t n, int64_t k,
                  at::Tensor& out) {
  check_packed(qw, gs, n, k);
  QERL_CHECK(g.is_cuda() && g.dim() == 2 && g.size(1) == n, "qerl: g must be [M, %lld], got %s", (long long)n,
             qerl_check::shape(g.sizes()).c_str());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == g.size(0) && out.size(1) == k && out.scalar_type() == g.scalar_type(),
              "qerl: out must be [M, k] of g's dtype");
  c10::cuda::CUDAGuard guard(qw.device());
  at::Tensor w = at::empty({n, k}, g.options());
  dequantize_out(qw, gs, n, k, w);
  at::mm_out(out, g, w);
}

void set_large_m_threshold(int64_t m) { g_large_m_threshold = m; }
void set_cluster(bool on) { g_cluster = on ? 1 : 0; }
void set_cluster_max_m(int64_t m) {
  TORCH_CHECK(m >= 0, "qerl: the cluster M limit must be >= 0");
  g_cluster_max_m = m;
}
void set_split_override(int64_t s) {
  TORCH_CHECK(s >= 0, "qerl: the split override must be >= 0 (0: chosen per shape)");
  g_split_override = s;
}
void set_v2_grid(int64_t p) {
  TORCH_CHECK(p >= 0, "qerl: the stream-K grid override must be >= 0 (0: chosen per shape)");
  g_v2_grid = p;
}
void set_v2_aligned(bool on) { g_v2_aligned = on ? 1 : 0; }
void set_v2_cluster(bool on) { g_v2_cluster = on ? 1 : 0; }
void set_v2_prefetch(int64_t tiles) {
  TORCH_CHECK(tiles >= 0 && tiles <= 255, "qerl: the L2 prefetch distance must be 0 ... 255 tiles");
  TORCH_CHECK(tiles == 0 || kV2PrefetchBuilt,
              "qerl: this kernel build has no rolling L2 prefetch (add -DQERL_V2_PREFETCH_LOOP to QERL_KERNEL_ARCH_FLAGS)");
  g_v2_prefetch = (int)tiles;
}
void set_fixup(int64_t v) {
  TORCH_CHECK(v >= 0 && v <= 2, "qerl: fixup must be 0 (auto, per M), 1 (batched) or 2 (serial)");
  g_fixup = (int)v;
}
void set_variant(int64_t v) {
  TORCH_CHECK(v >= 0 && v <= 5,
              "qerl: variant must be 0 (default), 1 (alternative configuration), 2 (v2), 3 (auto, per shape), 4 "
              "(v2 with 8 warps per block) or 5 (v2 with 10 warps per block up to M = 16)");
  g_variant = (int)v;
}
int64_t get_variant() { return g_variant; }
int64_t get_large_m_threshold() { return g_large_m_threshold; }
void set_tc_max_m(int64_t m) {
  TORCH_CHECK(m >= 0, "qerl: the tiled kernel's M limit must be >= 0 (0: never chosen)");
  g_tc_max_m = m;
}
void set_tc_cfg(int64_t c) {
  TORCH_CHECK(c >= 0 && c <= kTcCfgs, "qerl: tiled configuration must be 0 (auto), 1-3 (mma.sync: 128 x 128, "
                                      "128 x 64 with 8 warps, 128 x 64 with 4) or 4-7 (wgmma: 128 x 128, 256 x 128, "
                                      "128 x 64, 64 x 128)");
  g_tc_cfg = (int)c;
}
void set_tc_split(int64_t s) {
  TORCH_CHECK(s >= 0, "qerl: the tiled kernel's split override must be >= 0 (0: chosen per shape)");
  g_tc_split = s;
}

#ifdef QERL_TIMELINE
// the timeline buffer (uint8 CUDA tensor, a multiple of 128 bytes; empty: off) on the current device; resets the count
void set_timeline(const at::Tensor& buf) {
  QERL_CHECK(buf.numel() == 0 || (buf.is_cuda() && buf.scalar_type() == at::kByte && buf.is_contiguous() &&
                                  buf.numel() % 128 == 0),
             "qerl: the timeline buffer must be a contiguous uint8 CUDA tensor of a multiple of 128 bytes");
  TlRecord* p = buf.numel() ? reinterpret_cast<TlRecord*>(buf.data_ptr()) : nullptr;
  const unsigned int cap = (unsigned int)(buf.numel() / 128), zero = 0;
  C10_CUDA_CHECK(cudaMemcpyToSymbol(g_tl_buf, &p, sizeof(p)));
  C10_CUDA_CHECK(cudaMemcpyToSymbol(g_tl_cap, &cap, sizeof(cap)));
  C10_CUDA_CHECK(cudaMemcpyToSymbol(g_tl_count, &zero, sizeof(zero)));
}
// records appended since set_timeline (may exceed the capacity: the rest were dropped)
int64_t timeline_count() {
  unsigned int n = 0;
  C10_CUDA_CHECK(cudaMemcpyFromSymbol(&n, g_tl_count, sizeof(n)));
  return (int64_t)n;
}
#endif

}  // namespace qerl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_out", &qerl::linear_out,
        "x @ W^T (+ bias) into out; returns the path (0 mma kernel, 1 dequant+cuBLAS, 2 tiled kernel)", py::arg("x"), py::arg("qw"),
        py::arg("gs"), py::arg("n"), py::arg("k"), py::arg("out"), py::arg("path"), py::arg("bias") = py::none());
  m.def("linear_lora_out", &qerl::linear_lora_out,
        "x @ W^T (+ bias) + hs @ bs into out in one small-M kernel launch; false (nothing launched) where that kernel "
        "does not run the product or take the term",
        py::arg("x"), py::arg("qw"), py::arg("gs"), py::arg("n"), py::arg("k"), py::arg("out"), py::arg("bias"),
        py::arg("hs"), py::arg("bs"), py::arg("segs") = std::vector<int64_t>());
  m.def("linear_silu_out", &qerl::linear_silu_out,
        "silu(x @ Wg^T) * (x @ Wu^T) into out [M, n/2] for a fused gate/up weight (gate rows first) in one small-M "
        "kernel launch; false (nothing launched) where that kernel does not take it",
        py::arg("x"), py::arg("qw"), py::arg("gs"), py::arg("n"), py::arg("k"), py::arg("out"),
        py::arg("hs") = py::none(), py::arg("bs") = py::none(), py::arg("segs") = std::vector<int64_t>());
  m.def("set_pdl", [](bool on) { qerl_pdl::enabled_flag() = on ? 1 : 0; },
        "programmatic dependent launch of the small-M kernels (and of qerl_fused's) on or off");
  m.def("get_pdl", [] { return qerl_pdl::enabled_flag() != 0; });
  m.def("set_cluster", &qerl::set_cluster,
        "split-K of the small-M mma kernel reduced in thread-block clusters (sm_90+) instead of a workspace");
  m.def("get_cluster", [] { return qerl::g_cluster != 0; });
  m.def("set_cluster_max_m", &qerl::set_cluster_max_m, "largest M whose K splits may reduce in a cluster (default 32)");
  m.def("get_cluster_max_m", [] { return qerl::g_cluster_max_m; });
  m.def("set_v2_aligned", &qerl::set_v2_aligned,
        "row-group-aligned grids of the stream-K kernel at M <= 16 where they fill the GPU (default on)");
  m.def("get_v2_aligned", [] { return qerl::g_v2_aligned != 0; });
  m.def("last_v2_grid", [] { return qerl::g_last_v2_grid; }, "CTAs of the last stream-K launch");
  m.def("set_v2_cluster", &qerl::set_v2_cluster,
        "split-K sums of the stream-K kernels' aligned grids through thread-block clusters (sm_90; default on)");
  m.def("get_v2_cluster", [] { return qerl::g_v2_cluster != 0; });
  m.def("set_v2_prefetch", &qerl::set_v2_prefetch,
        "the stream-K kernels' rolling L2 prefetch distance in K tiles (0: off, the default)");
  m.def("get_v2_prefetch", [] { return (int64_t)qerl::g_v2_prefetch; });
  m.def("has_v2_prefetch", [] { return qerl::kV2PrefetchBuilt; },
        "whether this build has the stream-K kernels' rolling L2 prefetch (-DQERL_V2_PREFETCH_LOOP)");
  m.def("last_v2_cluster", [] { return (int64_t)qerl::g_last_v2_cluster; },
        "cluster size of the last stream-K launch (0: none)");
  m.def("set_v2_grid", &qerl::set_v2_grid, "force the stream-K kernel's CTA count (0: chosen per shape; probes)");
  m.def("set_split_override", &qerl::set_split_override, "force the K split of the small-M mma kernel (0: auto)");
  m.def("last_split", [] { return qerl::g_last_split; },
        "K split of the last small-M mma launch (v1 kernel), negative when reduced in a cluster; 0 after a stream-K "
        "(v2) launch");
  m.def("linear_t_out", &qerl::linear_t_out, "g @ W into out");
  m.def("dequantize_out", &qerl::dequantize_out, "dense W into out");
  m.def("dequantize_many_out", &qerl::dequantize_many_out,
        "several packed weights into consecutive bf16 blocks of one flat out, up to 8 per launch");
  m.def("set_large_m_threshold", &qerl::set_large_m_threshold);
  m.def("choose_path", &qerl::choose_path,
        "the path linear_out takes for bf16 x of M rows: 0 mma, 1 dequant+cuBLAS, 2 tiled tensor-core kernel");
  m.def("set_tc_max_m", &qerl::set_tc_max_m, "largest M the auto path gives the tiled kernel (0: never)");
  m.def("get_tc_max_m", [] { return qerl::g_tc_max_m; });
  m.def("set_tc_cfg", &qerl::set_tc_cfg,
        "the tiled kernel's tile (0 auto; mma.sync: 1 128x128, 2 128x64 8 warps, 3 128x64 4 warps; wgmma (sm_90a): "
        "4 128x128, 5 256x128, 6 128x64, 7 64x128)");
  m.def("wgmma_available", [](int64_t dev) { return qerl::wgmma_available((int)dev); },
        "whether the wgmma tiles (4-7) run on this device: cc 9.0 and a build with sm_90a code");
  m.def("set_tc_split", &qerl::set_tc_split, "force the tiled kernel's K split (0: chosen per shape)");
  m.def("last_tc", [] { return qerl::g_last_tc; }, "the last tiled launch: configuration * 1000 + K split");
  m.def("get_large_m_threshold", &qerl::get_large_m_threshold);
  m.def("set_variant", &qerl::set_variant,
        "small-M kernel: 0 default, 1 alternative mma configuration, 2 v2 (stream-K) for M <= 64, 3 auto (per shape), "
        "4 v2 with 8 warps per block");
  m.def("get_variant", &qerl::get_variant);
  m.def("auto_variant", [](int64_t m, int64_t n, int64_t k) { return (int64_t)qerl::auto_choice(m, n, k); },
        "the small-M variant auto picks for x of m rows and an [n, k] weight (the set_variant codes)");
  m.def("set_fixup", &qerl::set_fixup,
        "stream-K fixup of the v2 kernel: 0 auto (per M), 1 batched (4 elements x 8 slots in flight), 2 serial");
  m.def("get_fixup", [] { return (int64_t)qerl::g_fixup; });
#ifdef QERL_TIMELINE
  m.def("set_timeline", &qerl::set_timeline, "per-CTA timestamps of the small-M kernels into a uint8 buffer (probe builds)");
  m.def("timeline_count", &qerl::timeline_count, "records appended since set_timeline");
#endif
}
#endif
