// One decode step's attention over the KV cache (the rollout engine's T = 1 forwards), included by fused_ops.cu.
//
//   out[b, h] = sum_j softmax_j(q[b, h] . k[b, h / G, j] * scale) v[b, h / G, j]   over the slots j <= slot
//   whose key_mask[b, j] is set (the step's own slot always counts), G = H / KV query heads per KV head.
//
// Why not SDPA: for one query token cuDNN's flash kernel treats each of the H query heads on its own (every KV
// head's cache is read G times, from L2) and reads the whole preallocated cache under the additive mask. Here a
// block takes (row, KV head, split of the attended slots) and serves the G query heads from one read of its
// slots, and only the slots up to the step's one are read (slot read on the device: a CUDA graph replays it).
//
// Block (split s, KV head, row): its slots' K and V rows go to shared memory with cp.async, all in flight at
// once (K in one group, V in a second one, so the scores start when K has landed). A cache row of D bf16 is
// read by D / 8 lanes, 16 bytes each; each lane keeps its 8 dimensions of the G query heads in registers
// (pre-multiplied by scale * log2 e), so a slot's G partial dot products need no shared-memory reads of q; a
// reduce-scatter over the row's lanes (4 + 2 + 1 shuffles, one more at D = 128) leaves one head's score per lane.
// Softmax over the block's slots per head (exp2, fp32), then p . V with the same lane layout (fp32
// accumulators), the slot groups' partials added through shared memory in a fixed order. With one split the
// block writes the normalized output; with more, each block writes its unnormalized partial, its max and sum of
// exponentials to a workspace, and the last block of the (row, KV head) pair (a self-resetting ticket) adds them
// in split order: the result does not depend on the blocks' scheduling.
//
// Numerics: fp32 scores, probabilities and accumulation from bf16 inputs, one bf16 rounding of the output
// (SDPA's flash kernel rounds the probabilities to bf16 before p . V: the two differ by about that rounding).

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnMaxGroup = 8;                        // query heads per KV head
constexpr int kAttnBufBytes = 32768;                    // the K buffer (then the partials) and the V buffer, each
constexpr int kAttnMaxSplits = 256;                     // blocks per (row, KV head) pair
constexpr int kAttnMaxPairs = 65536;                    // (row, KV head) pairs: one ticket each
constexpr int kAttnRecord = kAttnMaxGroup * 128 + 16;   // workspace floats per partial (D <= 128): o, m[8], l[8]

template <int D>
struct AttnCfg {
  static_assert(D == 64 || D == 128, "decode attention: head_dim 64 or 128");
  static constexpr int kLanes = D / 8;                  // lanes per cache row, 8 dimensions (16 bytes) each
  static constexpr int kRowsPerWarp = 32 / kLanes;
  static constexpr int kGroups = kAttnWarps * kRowsPerWarp;   // slot groups: group g takes slots g, g + kGroups, ...
  static constexpr int kMaxChunk = kAttnBufBytes / (D * 2);   // slots per block
  static constexpr int kScStride = kMaxChunk + 4;              // a head's scores (padded: the 8 heads of a slot
                                                               // land in 8 banks)
  static constexpr size_t kSmem = 2 * kAttnBufBytes + kAttnMaxGroup * kScStride * sizeof(float) + kMaxChunk;
  static_assert(kGroups * kAttnMaxGroup * D * sizeof(float) <= kAttnBufBytes, "the partials fit the K buffer");
  static_assert(kAttnMaxSplits * kAttnMaxGroup * sizeof(float) <= kAttnBufBytes, "the split weights fit the V buffer");
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void to_float8(const Vec8& v, float (&o)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) o[j] = f(v.v[j]);
}

template <int D>
__global__ void __launch_bounds__(kAttnThreads) decode_attn_kernel(
    const bf16* __restrict__ q,                                  // [B, H, D] (the step's one token)
    const bf16* __restrict__ kc, const bf16* __restrict__ vc,    // [B, KV, S, D]
    const bool* __restrict__ key_mask, int64_t km_stride,        // [B, >= S]
    const int64_t* __restrict__ slot,                            // attends to slots [0, *slot]
    bf16* __restrict__ out,                                      // [B, H * D]
    float* __restrict__ ws, int* __restrict__ tickets, int n_kv, int group, int64_t slots, float scale_log2) {
  using C = AttnCfg<D>;
  extern __shared__ __align__(16) unsigned char attn_smem[];
  bf16* ks = reinterpret_cast<bf16*>(attn_smem);
  bf16* vs = reinterpret_cast<bf16*>(attn_smem + kAttnBufBytes);
  float* sc = reinterpret_cast<float*>(attn_smem + 2 * kAttnBufBytes);  // [8][kScStride]: scores, then p
  unsigned char* live = attn_smem + 2 * kAttnBufBytes + kAttnMaxGroup * C::kScStride * sizeof(float);  // per slot
  float* red = reinterpret_cast<float*>(attn_smem);                    // [kGroups][8][D], once K is read
  float* wsplit = reinterpret_cast<float*>(attn_smem + kAttnBufBytes);  // [splits][8], once V is read
  __shared__ float m_s[kAttnMaxGroup], l_s[kAttnMaxGroup];
  __shared__ bool last_s;

  const int splits = gridDim.x, split = blockIdx.x, kvh = blockIdx.y, bi = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int part = lane % C::kLanes;                          // this lane's 8 dimensions of a row
  const int grp = warp * C::kRowsPerWarp + lane / C::kLanes;  // this lane's slot group
  qerl_pdl::trigger();
  qerl_pdl::wait();  // q and the cache rows are the previous kernel's output

  const int64_t s_now = *slot;
  const int n = static_cast<int>(s_now < 0 ? 1 : (s_now >= slots ? slots : s_now + 1));  // slots [0, n)
  const int chunk = ((n + splits - 1) / splits + 7) & ~7;  // <= kMaxChunk (the host sizes the splits)
  const int s0 = min(n, split * chunk), len = min(n, s0 + chunk) - s0;
  const int64_t pair = static_cast<int64_t>(bi) * n_kv + kvh;
  {
    const bf16* kp = kc + (pair * slots + s0) * D;
    const bf16* vp = vc + (pair * slots + s0) * D;
    for (int i = tid; i < len * (D / 8); i += kAttnThreads) cp_async16(ks + i * 8, kp + i * 8);
    cp_async_commit();
    for (int i = tid; i < len * (D / 8); i += kAttnThreads) cp_async16(vs + i * 8, vp + i * 8);
    cp_async_commit();
    const bool* km = key_mask + static_cast<int64_t>(bi) * km_stride + s0;
    for (int j = tid; j < len; j += kAttnThreads) live[j] = s0 + j == n - 1 || km[j];  // the own slot counts
  }
  float qv[kAttnMaxGroup][8];
  {
    const bf16* qp = q + (pair * group) * D + part * 8;  // query heads kvh * G ... kvh * G + G - 1 of row bi
#pragma unroll
    for (int h = 0; h < kAttnMaxGroup; ++h) {
      if (h < group) {
        to_float8(ld8(qp + h * D), qv[h]);
#pragma unroll
        for (int j = 0; j < 8; ++j) qv[h][j] *= scale_log2;
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) qv[h][j] = 0.f;
      }
    }
  }
  const int my_head = ((lane & (C::kLanes / 2)) ? 4 : 0) + ((lane & (C::kLanes / 4)) ? 2 : 0) +
                      ((lane & (C::kLanes / 8)) ? 1 : 0);  // the head whose score the reduce-scatter leaves here
  const bool writer = C::kLanes == 8 || (lane & 1) == 0;
  cp_async_wait<1>();
  __syncthreads();  // (also for live[])
  // scores (log2 units): every lane of a warp runs every round (the shuffles need all 32)
  for (int j0 = 0; j0 < len; j0 += C::kGroups) {
    const int j = j0 + grp;
    const bool in = j < len;
    float kf[8];
    if (in) {
      to_float8(ld8(ks + j * D + part * 8), kf);
    } else {
#pragma unroll
      for (int t = 0; t < 8; ++t) kf[t] = 0.f;
    }
    float a8[8];
#pragma unroll
    for (int h = 0; h < 8; ++h) {
      float s = 0.f;
#pragma unroll
      for (int t = 0; t < 8; ++t) s = fmaf(qv[h][t], kf[t], s);
      a8[h] = s;
    }
    float a4[4], a2[2], a1;
    {
      const bool up = lane & (C::kLanes / 2);
#pragma unroll
      for (int i = 0; i < 4; ++i)
        a4[i] = (up ? a8[i + 4] : a8[i]) + __shfl_xor_sync(0xffffffffu, up ? a8[i] : a8[i + 4], C::kLanes / 2);
    }
    {
      const bool up = lane & (C::kLanes / 4);
#pragma unroll
      for (int i = 0; i < 2; ++i)
        a2[i] = (up ? a4[i + 2] : a4[i]) + __shfl_xor_sync(0xffffffffu, up ? a4[i] : a4[i + 2], C::kLanes / 4);
    }
    {
      const bool up = lane & (C::kLanes / 8);
      a1 = (up ? a2[1] : a2[0]) + __shfl_xor_sync(0xffffffffu, up ? a2[0] : a2[1], C::kLanes / 8);
    }
    if (C::kLanes == 16) a1 += __shfl_xor_sync(0xffffffffu, a1, 1);
    if (in && writer) sc[my_head * C::kScStride + j] = live[j] ? a1 : -INFINITY;
  }
  __syncthreads();
  // softmax over this block's slots, per head (warp w: heads w and w + 4); heads past G get p = 0
#pragma unroll
  for (int hh = 0; hh < kAttnMaxGroup / kAttnWarps; ++hh) {
    const int h = warp + kAttnWarps * hh;
    float* row = sc + h * C::kScStride;
    if (h >= group) {
      for (int j = lane; j < len; j += 32) row[j] = 0.f;
      continue;
    }
    float m = -INFINITY;
    for (int j = lane; j < len; j += 32) m = fmaxf(m, row[j]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float l = 0.f;
    for (int j = lane; j < len; j += 32) {
      const float p = m == -INFINITY ? 0.f : exp2f(row[j] - m);
      row[j] = p;
      l += p;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) {
      m_s[h] = m;
      l_s[h] = l;
    }
  }
  cp_async_wait<0>();
  __syncthreads();
  // p . V: lane (group, part) adds its slots' rows of its 8 dimensions for all 8 heads
  float acc[kAttnMaxGroup][8];
#pragma unroll
  for (int h = 0; h < kAttnMaxGroup; ++h)
#pragma unroll
    for (int t = 0; t < 8; ++t) acc[h][t] = 0.f;
  for (int j = grp; j < len; j += C::kGroups) {
    float vf[8];
    to_float8(ld8(vs + j * D + part * 8), vf);
#pragma unroll
    for (int h = 0; h < kAttnMaxGroup; ++h) {
      const float p = sc[h * C::kScStride + j];
#pragma unroll
      for (int t = 0; t < 8; ++t) acc[h][t] = fmaf(p, vf[t], acc[h][t]);
    }
  }
  // the groups' partials through shared memory (the K buffer, read by the scores only), added in group order
  {
    float* rp = red + grp * kAttnMaxGroup * D + part * 8;
#pragma unroll
    for (int h = 0; h < kAttnMaxGroup; ++h) {
      reinterpret_cast<float4*>(rp + h * D)[0] = make_float4(acc[h][0], acc[h][1], acc[h][2], acc[h][3]);
      reinterpret_cast<float4*>(rp + h * D)[1] = make_float4(acc[h][4], acc[h][5], acc[h][6], acc[h][7]);
    }
  }
  __syncthreads();
  const int outs = group * D;
  bf16* op = out + (pair * group) * D;  // [B, H * D]: the heads kvh * G ... of row bi
  if (splits == 1) {
    for (int idx = tid; idx < outs; idx += kAttnThreads) {
      const int h = idx / D, d = idx % D;
      float s = 0.f;
#pragma unroll
      for (int g = 0; g < C::kGroups; ++g) s += red[(g * kAttnMaxGroup + h) * D + d];
      op[idx] = b(s / l_s[h]);  // l > 0: the step's own slot is always attended
    }
    return;
  }
  float* mine = ws + (pair * splits + split) * kAttnRecord;
  for (int idx = tid; idx < outs; idx += kAttnThreads) {
    const int h = idx / D, d = idx % D;
    float s = 0.f;
#pragma unroll
    for (int g = 0; g < C::kGroups; ++g) s += red[(g * kAttnMaxGroup + h) * D + d];
    mine[idx] = s;
  }
  if (tid < kAttnMaxGroup) {
    mine[kAttnMaxGroup * 128 + tid] = tid < group ? m_s[tid] : -INFINITY;
    mine[kAttnMaxGroup * 128 + kAttnMaxGroup + tid] = tid < group ? l_s[tid] : 0.f;
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) last_s = atomicAdd(tickets + pair, 1) == splits - 1;
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  const float* all = ws + pair * splits * kAttnRecord;
  // each head's weights exp2(m_s - M) / sum_s exp2(m_s - M) l_s, in split order (V buffer: p . V is done)
  if (tid < group) {
    float mx = -INFINITY;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, __ldcg(all + s * kAttnRecord + kAttnMaxGroup * 128 + tid));
    float den = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float ms = __ldcg(all + s * kAttnRecord + kAttnMaxGroup * 128 + tid);
      const float w = ms == -INFINITY ? 0.f : exp2f(ms - mx);
      wsplit[s * kAttnMaxGroup + tid] = w;
      den += w * __ldcg(all + s * kAttnRecord + kAttnMaxGroup * 128 + kAttnMaxGroup + tid);
    }
    m_s[tid] = 1.f / den;  // den > 0: the split holding the step's own slot has l >= 1
  }
  __syncthreads();
  for (int idx = tid; idx < outs; idx += kAttnThreads) {
    const int h = idx / D;
    float s = 0.f;
#pragma unroll 8
    for (int sp = 0; sp < splits; ++sp) s = fmaf(wsplit[sp * kAttnMaxGroup + h], __ldcg(all + sp * kAttnRecord + idx), s);
    op[idx] = b(s * m_s[h]);
  }
  if (tid == 0) tickets[pair] = 0;  // for the next launch (graph replays included)
}
