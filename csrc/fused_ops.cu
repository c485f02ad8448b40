// Fused elementwise kernels of a decoder layer on bf16 rows (the CUDA rollout engine's no-grad path).
//
// Each one replaces a chain of small torch kernels and rounds where that chain rounds, so its output equals
// the chain's (bit-exact for silu_mul and rope_kv; add_rmsnorm reduces the squares in another order, so its
// normalizer can differ in the last fp32 bit and an output by one bf16 unit):
//   * add_rmsnorm: s = bf16(h + d) (the residual, written out), x = bf16(float(s) * rstd * float(w)),
//     rstd = rsqrt(mean(float(s)^2) + eps); w shared [H] or one row per group of rows; d optional.
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
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

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
__device__ __forceinline__ bf16 b(float x) { return __float2bfloat16_rn(x); }

// one block per row; each thread keeps its 8-wide chunks of the summed row in registers (H <= 8 * 4 * threads)
constexpr int kNormThreads = 256;
constexpr int kNormChunks = 4;

__global__ void __launch_bounds__(kNormThreads) add_rmsnorm_kernel(
    const bf16* __restrict__ h, const bf16* __restrict__ d, const bf16* __restrict__ w, int64_t w_stride,
    int rows_per_w, bf16* __restrict__ h_out, bf16* __restrict__ x_out, int width, float eps) {
  qerl_pdl::trigger();
  qerl_pdl::wait();
  const int64_t row = blockIdx.x;
  const bf16* hr = h + row * width;
  const bf16* dr = d ? d + row * width : nullptr;
  const bf16* wr = w + (row / rows_per_w) * w_stride;
  Vec8 s[kNormChunks];
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < kNormChunks; ++c) {
    const int i = (c * kNormThreads + threadIdx.x) * 8;
    if (i < width) {
      Vec8 a = ld8(hr + i);
      if (dr) {
        const Vec8 e = ld8(dr + i);
#pragma unroll
        for (int j = 0; j < 8; ++j) a.v[j] = b(f(a.v[j]) + f(e.v[j]));
        st8(h_out + row * width + i, a);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) ss += f(a.v[j]) * f(a.v[j]);
      s[c] = a;
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
#pragma unroll
  for (int c = 0; c < kNormChunks; ++c) {
    const int i = (c * kNormThreads + threadIdx.x) * 8;
    if (i < width) {
      const Vec8 wv = ld8(wr + i);
      Vec8 o;
#pragma unroll
      for (int j = 0; j < 8; ++j) o.v[j] = b(f(wv.v[j]) * (rstd * f(s[c].v[j])));
      st8(x_out + row * width + i, o);
    }
  }
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
  for (int j = 0; j < 8; ++j) {
    const float x = f(gv.v[j]);
    const bf16 s = b(x / (1.0f + expf(-x)));
    o.v[j] = b(f(s) * f(uv.v[j]));
  }
  st8(out + r * static_cast<int64_t>(width) + i, o);
}

// LoRA terms of the engine's decode steps (M <= 16 rows), in two small PDL kernels instead of two cuBLAS matmuls
// (each of those often a gemm plus a split-K reduce, none overlapping its neighbours):
//   lora_shrink: part[s, m, r] = sum over K chunk s of x[m, k] * a[r, k]                       (fp32)
//   lora_expand: out[m, n] = bf16(float(y[m, n]) + sum_r float(bf16(sum_s part[s, m, r])) * float(bs[r, n]))
// which is addmm(y, x @ a^T, bs) with h = x @ a^T rounded to bf16 in between, as the cuBLAS chain rounds it, and
// fp32 accumulation; every sum runs in a fixed order (the result does not depend on scheduling).
constexpr int kLoraMaxM = 16;
constexpr int kShrinkWarps = 8;
constexpr int kShrinkRowsPerWarp = 2;
constexpr int kShrinkRows = kShrinkWarps * kShrinkRowsPerWarp;  // rows of a per block
constexpr int kShrinkStep = 256;                                // inputs per step: 8 per lane
constexpr int kExpandThreads = 64;                              // 2 output columns each: more blocks
constexpr int kExpandPartials = 2048;  // most partial sums the expand kernel gathers (8 KB: 2 L2 round trips)

template <int MT>
__global__ void __launch_bounds__(kShrinkWarps * 32) lora_shrink_kernel(const bf16* __restrict__ x,
                                                                        const bf16* __restrict__ a,
                                                                        float* __restrict__ part, int M, int K,
                                                                        int R, int kc) {
  qerl_pdl::trigger();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int s = blockIdx.x;
  const int r0 = blockIdx.y * kShrinkRows + warp * kShrinkRowsPerWarp;
  const int k0 = s * kc, k1 = min(K, k0 + kc);
  float acc[kShrinkRowsPerWarp][MT];
#pragma unroll
  for (int i = 0; i < kShrinkRowsPerWarp; ++i)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[i][m] = 0.f;
  qerl_pdl::wait();
  constexpr int U = 4;  // steps whose factor loads are in flight together (latency, not bandwidth, bounds this)
  for (int kb = k0; kb < k1; kb += U * kShrinkStep) {
    Vec8 av[U][kShrinkRowsPerWarp];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * kShrinkStep + 8 * lane;
#pragma unroll
      for (int i = 0; i < kShrinkRowsPerWarp; ++i)
        if (k < k1 && r0 + i < R) av[u][i] = ld8(a + (size_t)(r0 + i) * K + k);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int k = kb + u * kShrinkStep + 8 * lane;
      if (k >= k1) break;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= M) break;
        const Vec8 xv = ld8(x + (size_t)m * K + k);
#pragma unroll
        for (int i = 0; i < kShrinkRowsPerWarp; ++i)
          if (r0 + i < R) {
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[i][m] += f(av[u][i].v[j]) * f(xv.v[j]);
          }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kShrinkRowsPerWarp; ++i)
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      float v = acc[i][m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      if (lane == 0 && m < M && r0 + i < R) part[((size_t)s * M + m) * R + r0 + i] = v;
    }
}

template <int MT>
__global__ void __launch_bounds__(kExpandThreads) lora_expand_kernel(const float* __restrict__ part, int S,
                                                                     const bf16* __restrict__ y,
                                                                     const bf16* __restrict__ bs,
                                                                     bf16* __restrict__ out, int M, int N, int R) {
  qerl_pdl::trigger();
  extern __shared__ float sm[];  // [S][M][R] partials, then h [M][R]
  const int tid = threadIdx.x;
  const int total = S * M * R, mr = M * R;
  float* hs = sm + total;
  qerl_pdl::wait();
  for (int i0 = tid; i0 < total; i0 += 16 * kExpandThreads) {  // sixteen loads in flight per thread
    float v[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int i = i0 + j * kExpandThreads;
      v[j] = i < total ? __ldcg(part + i) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j)
      if (i0 + j * kExpandThreads < total) sm[i0 + j * kExpandThreads] = v[j];
  }
  __syncthreads();
  for (int e = tid; e < mr; e += kExpandThreads) {
    float sum = 0.f;
    for (int s = 0; s < S; ++s) sum += sm[s * mr + e];
    hs[e] = f(b(sum));
  }
  __syncthreads();
  const int n = (blockIdx.x * kExpandThreads + tid) * 2;
  if (n >= N) return;
  float acc[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
  constexpr int RB = 32;  // rows of bs whose loads are in flight together (one round trip per batch)
  for (int r0 = 0; r0 < R; r0 += RB) {
    __nv_bfloat162 bv[RB];
#pragma unroll
    for (int j = 0; j < RB; ++j)
      if (r0 + j < R) bv[j] = *reinterpret_cast<const __nv_bfloat162*>(bs + (size_t)(r0 + j) * N + n);
#pragma unroll
    for (int j = 0; j < RB; ++j) {
      if (r0 + j >= R) break;
      const float b0 = __low2float(bv[j]), b1 = __high2float(bv[j]);
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m >= M) break;
        const float hv = hs[m * R + r0 + j];
        acc[m][0] += hv * b0;
        acc[m][1] += hv * b1;
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m >= M) break;
    const __nv_bfloat162 yv = *reinterpret_cast<const __nv_bfloat162*>(y + (size_t)m * N + n);
    *reinterpret_cast<__nv_bfloat162*>(out + (size_t)m * N + n) =
        __floats2bfloat162_rn(__low2float(yv) + acc[m][0], __high2float(yv) + acc[m][1]);
  }
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
  const Vec8 cl = ld8(cr + lo), ch = ld8(cr + hi), sl = ld8(sr + lo), sh = ld8(sr + hi);
  Vec8 ol, oh;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    // rotate_half(x) = cat(-x[half:], x[:half])
    ol.v[j] = b(f(b(f(xl.v[j]) * f(cl.v[j]))) + f(b(-f(xh.v[j]) * f(sl.v[j]))));
    oh.v[j] = b(f(b(f(xh.v[j]) * f(ch.v[j]))) + f(b(f(xl.v[j]) * f(sh.v[j]))));
  }
  st8(dst + lo, ol);
  st8(dst + hi, oh);
}

#ifndef QERL_NO_TORCH

namespace {

const bf16* cptr(const at::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr()); }
bf16* mptr(const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kBFloat16, "qerl_fused: ", name, " must be a CUDA bf16 tensor");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "qerl_fused: ", name, " must be 16-byte aligned");
}

int blocks_for(int64_t threads, int per_block) { return static_cast<int>((threads + per_block - 1) / per_block); }

}  // namespace

// h, d: [rows, width] contiguous (d may be undefined: norm only); w: [width] or [groups, width] with
// rows = groups * rows_per_w; writes h_out = h + d (when d is given) and x_out = rmsnorm(h_out) * w
void add_rmsnorm(const at::Tensor& h, const c10::optional<at::Tensor>& d, const at::Tensor& w, int64_t rows_per_w,
                 at::Tensor& h_out, at::Tensor& x_out, double eps) {
  check_bf16(h, "h");
  check_bf16(w, "w");
  check_bf16(x_out, "x_out");
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && x_out.sizes() == h.sizes() && x_out.is_contiguous(),
              "qerl_fused: add_rmsnorm needs contiguous [rows, width] h and x_out");
  const int64_t rows = h.size(0), width = h.size(1);
  TORCH_CHECK(width % 8 == 0 && width <= 8 * kNormChunks * kNormThreads, "qerl_fused: width ", width,
              " must be a multiple of 8 and at most ", 8 * kNormChunks * kNormThreads);
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
  if (rows == 0) return;
  const c10::cuda::CUDAGuard guard(h.device());
  C10_CUDA_CHECK(qerl_pdl::launch(add_rmsnorm_kernel, dim3(static_cast<unsigned>(rows)), dim3(kNormThreads), 0,
                                   c10::cuda::getCurrentCUDAStream().stream(), h.get_device(), cptr(h), dp, cptr(w),
                                   w.dim() == 1 ? int64_t(0) : width,
                                   static_cast<int>(w.dim() == 1 ? rows : rows_per_w), dp ? mptr(h_out) : nullptr,
                                   mptr(x_out), static_cast<int>(width), static_cast<float>(eps)));
}

// g, u: [rows, width] views with unit column stride and one shared row stride; out: [rows, width] contiguous
void silu_mul(const at::Tensor& g, const at::Tensor& u, at::Tensor& out) {
  check_bf16(g, "g");
  check_bf16(u, "u");
  check_bf16(out, "out");
  TORCH_CHECK(g.dim() == 2 && u.sizes() == g.sizes() && out.sizes() == g.sizes() && out.is_contiguous(),
              "qerl_fused: silu_mul needs g, u, out of one [rows, width] shape, out contiguous");
  TORCH_CHECK(g.stride(1) == 1 && u.stride(1) == 1 && g.stride(0) == u.stride(0) && g.stride(0) % 8 == 0 &&
                  g.size(1) % 8 == 0,
              "qerl_fused: silu_mul needs unit column strides, one row stride, widths and strides multiple of 8");
  const int64_t rows = g.size(0), width = g.size(1), n = rows * (width / 8);
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

// out [M, N] = y + bf16(x @ a^T) @ bs for M <= 16 decode rows (see lora_shrink_kernel): x [M, K], a [R, K],
// y / out [M, N], bs [R, N], all contiguous bf16; K % 8 == 0, N % 2 == 0, M * R <= 4096. Returns false (nothing
// launched) when the tensors are outside what the kernels take: the caller then uses its matmuls.
bool lora_add(const at::Tensor& x, const at::Tensor& a, const at::Tensor& y, const at::Tensor& bs, at::Tensor& out) {
  const at::Tensor* args[] = {&x, &a, &y, &bs, &out};
  for (const at::Tensor* t : args) {
    if (!t->is_cuda() || t->scalar_type() != at::kBFloat16 || !t->is_contiguous() || t->dim() != 2 ||
        reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0)
      return false;
  }
  const int64_t M = x.size(0), K = x.size(1), R = a.size(0), N = y.size(1);
  // (fused.lora_add raises on disagreeing shapes before calling; here they only decline: session 7's GPU run
  // crashed the process when a TORCH_CHECK of this function threw, cause not established)
  if (a.size(1) != K || y.size(0) != M || bs.size(0) != R || bs.size(1) != N || out.sizes() != y.sizes()) return false;
  if (M < 1 || M > kLoraMaxM || R < 1 || K % 8 != 0 || N % 2 != 0 || M * R > 4096) return false;
  const c10::cuda::CUDAGuard guard(x.device());
  const int dev = x.get_device();
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const int rt = static_cast<int>((R + kShrinkRows - 1) / kShrinkRows);
  // K chunks: enough blocks to spread the factor's bytes, no more partial sums than the expand kernel gathers
  // quickly (every one of its blocks reads them all), each chunk a whole number of steps
  int64_t s_want = std::max<int64_t>(1, std::min<int64_t>({32, (128 + rt - 1) / rt, kExpandPartials / (M * R)}));
  int64_t kc = (K + s_want - 1) / s_want;
  kc = (kc + kShrinkStep - 1) / kShrinkStep * kShrinkStep;
  const int64_t S = (K + kc - 1) / kc;
  at::Tensor part = at::empty({S * M * R}, x.options().dtype(at::kFloat));
  const size_t smem = static_cast<size_t>(S * M * R + M * R) * sizeof(float);
  const dim3 sgrid(static_cast<unsigned>(S), static_cast<unsigned>(rt));
  const dim3 egrid(static_cast<unsigned>((N / 2 + kExpandThreads - 1) / kExpandThreads));
  const int Mi = static_cast<int>(M), Ki = static_cast<int>(K), Ri = static_cast<int>(R), Ni = static_cast<int>(N);
  if (M <= 8) {
    C10_CUDA_CHECK(qerl_pdl::launch(lora_shrink_kernel<8>, sgrid, dim3(kShrinkWarps * 32), 0, stream, dev, cptr(x),
                                     cptr(a), part.data_ptr<float>(), Mi, Ki, Ri, static_cast<int>(kc)));
    C10_CUDA_CHECK(qerl_pdl::launch(lora_expand_kernel<8>, egrid, dim3(kExpandThreads), smem, stream, dev,
                                     static_cast<const float*>(part.data_ptr<float>()), static_cast<int>(S), cptr(y),
                                     cptr(bs), mptr(out), Mi, Ni, Ri));
  } else {
    C10_CUDA_CHECK(qerl_pdl::launch(lora_shrink_kernel<16>, sgrid, dim3(kShrinkWarps * 32), 0, stream, dev,
                                     cptr(x), cptr(a), part.data_ptr<float>(), Mi, Ki, Ri, static_cast<int>(kc)));
    C10_CUDA_CHECK(qerl_pdl::launch(lora_expand_kernel<16>, egrid, dim3(kExpandThreads), smem, stream, dev,
                                     static_cast<const float*>(part.data_ptr<float>()), static_cast<int>(S), cptr(y),
                                     cptr(bs), mptr(out), Mi, Ni, Ri));
  }
  return true;
}

#endif  // QERL_NO_TORCH

}  // namespace qerl_fused

#ifndef QERL_NO_TORCH
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rmsnorm", &qerl_fused::add_rmsnorm, "h_out = h + d; x_out = rmsnorm(h_out) * w (bf16 rows)");
  m.def("silu_mul", &qerl_fused::silu_mul, "out = silu(g) * u (bf16 rows)");
  m.def("rope_kv", &qerl_fused::rope_kv, "rotary on q and k of a fused qkv row; k, v into the KV cache");
  m.def("lora_add", &qerl_fused::lora_add,
        "out = y + bf16(x @ a^T) @ bs for decode rows (M <= 16); false when the shapes need the matmul path");
  m.def("set_pdl", [](bool on) { qerl_pdl::enabled_flag() = on ? 1 : 0; }, "programmatic dependent launch on/off");
}
#endif
