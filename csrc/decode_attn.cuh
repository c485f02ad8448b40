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
// Block (split s, KV head, row): its slots, in tiles of 16, go to the 4 warps round robin (warp w: tiles w,
// w + 4, ...); each warp copies its tiles' K and V rows to shared memory with cp.async (K in one group, V in a
// second one; 16-byte pieces XOR-swizzled by row, so ldmatrix reads are conflict-free; slots past the block's
// zero-filled) and works alone until the block's sum:
//   * scores on the tensor cores: mma.sync m16n8k16 with the G query heads as the 16 rows of A (rows G ... 15
//     zero; q straight from global memory into the fragments) and the tile's K rows as B (ldmatrix), fp32;
//   * softmax over the warp's slots per head (scale * log2 e applied to the fp32 scores, exp2, masked slots
//     -inf), the max and sum across a quad's lanes by shuffles;
//   * p . V on the tensor cores: p as the A fragment straight from the score accumulators, split into bf16
//     hi + lo (p - hi rounded again; together about 16 bits of p, so the product is within fp32 noise of p
//     in fp32), V as B through ldmatrix.trans; fp32 accumulators [8 heads x D].
// Session 17 measured the earlier design (the same blocks, scores and p . V as fp32 FMAs on the CUDA cores) at
// 0.5-0.96x SDPA: its time grew by 3.3 us per 256 attended slots at batch 8 on the H100, the FMA and shuffle
// work of a block, not its loads.
// The block's 4 warp partials (max, sum of exponentials, unnormalized output) are added in warp order through
// shared memory. With one split the block writes the normalized output. With 2 ... 8 splits on sm_90 the splits
// of a (row, KV head) pair run as one thread-block cluster: after a cluster barrier every block adds 1/S of the
// outputs over the S partials read from the others' shared memory, in split order. Otherwise each block writes
// its partial to a workspace and the last block of the pair (a self-resetting ticket) adds them, with the same
// formula in the same order: both give the same bits (tested), and neither depends on the blocks' scheduling.
//
// Rotary in the same kernel (rope.y set: fused.rope_decode_attn): q comes from the fused q/k/v projection row y
// with the rotary of rope_kv (rope_half, the same bits) applied by the block into shared memory, and the block
// whose slots hold the step's own slot makes that slot's rotary k and v itself: into its buffers (that row is not
// copied from the cache) and into the cache for the later steps. One kernel instead of rope_kv + decode_attn, the
// same bits in the output and the cache (tested).
//
// Numerics: bf16 q . k products exact, fp32 sums (tensor-core order), fp32 softmax, p in hi + lo bf16, fp32
// p . V sums, one bf16 rounding of the output (SDPA's flash kernel rounds p to bf16: about 2^-9 relative).

#include "warp_mma.cuh"

constexpr int kAttnThreads = 128;
constexpr int kAttnWarps = kAttnThreads / 32;
constexpr int kAttnMaxGroup = 8;                        // query heads per KV head (the A fragment's rows 0 ... 7)
constexpr int kAttnBufBytes = 32768;                    // the K buffer and the V buffer, each
constexpr int kAttnMaxSplits = 256;                     // blocks per (row, KV head) pair
constexpr int kAttnMaxCluster = 8;                      // splits reduced in a cluster (the portable size)
constexpr int kAttnMaxPairs = 65536;                    // (row, KV head) pairs: one ticket each
constexpr int kAttnRecord = kAttnMaxGroup * 128 + 16;   // floats per partial (D <= 128): o[8][D], m[8], l[8]

template <int D>
struct AttnCfg {
  static_assert(D == 64 || D == 128, "decode attention: head_dim 64 or 128");
  static constexpr int kPieces = D / 8;                       // 16-byte pieces per cache row
  static constexpr int kMaxChunk = kAttnBufBytes / (D * 2);   // slots per block
  static constexpr int kWarpTiles = kMaxChunk / 16 / kAttnWarps;   // 16-slot tiles per warp (2 or 4)
  static constexpr int kNT = D / 8;                           // 8-wide output column tiles
  static constexpr size_t kSmem = 2 * kAttnBufBytes;
  static_assert(kAttnMaxGroup * D * sizeof(float) <= 16 * D * 2, "a warp's partial fits its first K tile");
  static_assert(kAttnMaxSplits * (kAttnMaxGroup + 16) * sizeof(float) <= kAttnBufBytes,
                "the split weights and every split's m and l fit the V buffer");
  static_assert(kAttnRecord * sizeof(float) <= kAttnBufBytes, "a cluster partial fits the V buffer");
};

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }
// 16 bytes global -> shared, or 16 zero bytes (nothing read) where !valid
__device__ __forceinline__ void cp_async16_zfill(uint32_t saddr, const void* g, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(saddr), "l"(g), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo (the lower address / column)
  return *reinterpret_cast<const uint32_t*>(&v);
}

// rotary inputs of a fused decode step (y null: q and the step's cache rows are already made)
struct AttnRope {
  const bf16* y;      // [B, (H + 2 KV) * D] rows of the fused q/k/v projection (this step's token)
  int64_t y_stride;
  const bf16* cos;    // [B, D] rows (this step's position)
  const bf16* sin;
  int64_t cs_stride;
  int n_heads;
};

template <int D>
__global__ void __launch_bounds__(kAttnThreads) decode_attn_kernel(
    const bf16* __restrict__ q,                                  // [B, H, D] (the step's one token)
    bf16* __restrict__ kc, bf16* __restrict__ vc,                // [B, KV, S, D] (written: rope's own slot)
    const bool* __restrict__ key_mask, int64_t km_stride,        // [B, >= S]
    const int64_t* __restrict__ slot,                            // attends to slots [0, *slot]
    bf16* __restrict__ out,                                      // [B, H * D]
    float* __restrict__ ws, int* __restrict__ tickets, int n_kv, int group, int64_t slots, float scale_log2,
    int in_cluster, int late_trigger, AttnRope rope) {
  using C = AttnCfg<D>;
  extern __shared__ __align__(128) unsigned char attn_smem[];
  unsigned char* kbuf = attn_smem;
  float* vbuf = reinterpret_cast<float*>(attn_smem + kAttnBufBytes);  // (as floats once V is read)
  __shared__ float wm[kAttnWarps][kAttnMaxGroup], wl[kAttnWarps][kAttnMaxGroup], we[kAttnWarps][kAttnMaxGroup];
  __shared__ float m_s[kAttnMaxGroup], l_s[kAttnMaxGroup];
  __shared__ bool last_s;

  const int splits = gridDim.x, split = blockIdx.x, kvh = blockIdx.y, bi = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;  // mma fragment coordinates: row (head) g, column pair 2t
  // the next kernel may launch (PDL) at once, or once this block's loads have landed (late_trigger: its blocks'
  // L2 prefetches of their weights then do not compete with these loads)
  if (!late_trigger) qerl_pdl::trigger();
  qerl_pdl::wait();  // q and the cache rows are the previous kernel's output

  const int64_t s_now = *slot;
  const int n = static_cast<int>(s_now < 0 ? 1 : (s_now >= slots ? slots : s_now + 1));  // slots [0, n)
  const int chunk = ((n + splits - 1) / splits + 15) & ~15;  // <= kMaxChunk (the host sizes the splits)
  const int s0 = min(n, split * chunk), len = min(n, s0 + chunk) - s0;
  const int tiles = (len + 15) >> 4;
  const int64_t pair = static_cast<int64_t>(bi) * n_kv + kvh;
  const uint32_t kb = static_cast<uint32_t>(__cvta_generic_to_shared(kbuf));
  const uint32_t vb = kb + kAttnBufBytes;
  // buffer row j, 16-byte piece c: byte j * 2D + 16 (c ^ (j & 7))
  auto at = [](int j, int c) { return static_cast<uint32_t>(j * (2 * D) + ((c ^ (j & 7)) << 4)); };
  // rotary here: the buffer row of the step's own slot, where this block holds it (-1: none), made below
  const int j_own = rope.y != nullptr && s_now >= 0 && s_now < slots && s_now >= s0 && s_now < s0 + len
                        ? static_cast<int>(s_now - s0) : -1;
  {
    // this warp's tiles of one cache (K or V) into its buffer, one cp.async group
    auto copy_tiles = [&](uint32_t buf, const bf16* src) {
#pragma unroll
      for (int i = 0; i < C::kWarpTiles; ++i) {
        const int kt = warp + kAttnWarps * i;
        if (kt < tiles)
          for (int p = lane; p < 16 * C::kPieces; p += 32) {
            const int j = kt * 16 + p / C::kPieces, c = p % C::kPieces;
            if (j != j_own) cp_async16_zfill(buf + at(j, c), src + (j < len ? j * D + c * 8 : 0), j < len);
          }
      }
      cp_async_commit();
    };
    copy_tiles(kb, kc + (pair * slots + s0) * D);
    copy_tiles(vb, vc + (pair * slots + s0) * D);
  }
  __shared__ __align__(16) bf16 q_rot[kAttnMaxGroup * 128];
  if (rope.y != nullptr) {
    const bf16* yr = rope.y + static_cast<int64_t>(bi) * rope.y_stride;
    const bf16* cr = rope.cos + static_cast<int64_t>(bi) * rope.cs_stride;
    const bf16* sr = rope.sin + static_cast<int64_t>(bi) * rope.cs_stride;
    // piece c of a head (8 columns) and its rotate_half partner c +- D / 16
    auto rotated = [&](const bf16* head, int c) {
      const int c2 = c < C::kPieces / 2 ? c + C::kPieces / 2 : c - C::kPieces / 2;
      return rope_half(ld8(head + 8 * c), ld8(head + 8 * c2), ld8(cr + 8 * c), ld8(sr + 8 * c),
                       c >= C::kPieces / 2);
    };
    // this block's query heads kvh * G ... into q_rot [G][D]
    for (int p = tid; p < group * C::kPieces; p += kAttnThreads) {
      const int hh = p / C::kPieces, c = p % C::kPieces;
      st8(q_rot + hh * D + 8 * c, rotated(yr + static_cast<int64_t>(kvh * group + hh) * D, c));
    }
    // the step's own slot: the warp whose tile holds it makes the rotary k and the v row, into its buffers and the
    // cache (its own lanes read that row after the __syncwarp below)
    if (j_own >= 0 && warp == (j_own >> 4) % kAttnWarps) {
      for (int p = lane; p < 2 * C::kPieces; p += 32) {
        const bool is_k = p < C::kPieces;
        const int c = is_k ? p : p - C::kPieces;
        const bf16* head = yr + static_cast<int64_t>(rope.n_heads + (is_k ? 0 : n_kv) + kvh) * D;
        const Vec8 v = is_k ? rotated(head, c) : ld8(head + 8 * c);
        st8((is_k ? kc : vc) + (pair * slots + s_now) * D + 8 * c, v);
        const uint4 u = *reinterpret_cast<const uint4*>(&v);
        asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"r"((is_k ? kb : vb) + at(j_own, c)),
                     "r"(u.x), "r"(u.y), "r"(u.z), "r"(u.w)
                     : "memory");
      }
    }
    __syncthreads();  // (q_rot)
  }
  // q as the A fragment: rows g < G (rows g + 8 are zero), columns 16 kk + 2t (+ 1) and 16 kk + 8 + 2t (+ 1)
  uint32_t qa[D / 16][2];
  {
    const bf16* qp = (rope.y != nullptr ? q_rot + g * D : q + (pair * group + g) * D) + 2 * t;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      qa[kk][0] = g < group ? *reinterpret_cast<const uint32_t*>(qp + 16 * kk) : 0u;
      qa[kk][1] = g < group ? *reinterpret_cast<const uint32_t*>(qp + 16 * kk + 8) : 0u;
    }
  }
  // which of this lane's score slots are attended: tile i, element e -> slot 16 kt + 8 (e >> 1) + 2t + (e & 1)
  uint32_t live = 0;
  {
    const bool* km = key_mask + static_cast<int64_t>(bi) * km_stride + s0;
#pragma unroll
    for (int i = 0; i < C::kWarpTiles; ++i) {
      const int kt = warp + kAttnWarps * i;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = kt * 16 + 8 * (e >> 1) + 2 * t + (e & 1);
        if (kt < tiles && j < len && (s0 + j == n - 1 || km[j])) live |= 1u << (4 * i + e);
      }
    }
  }
  cp_async_wait<1>();
  __syncwarp();  // (the warp's K rows, copied by its own lanes)
  float sv[C::kWarpTiles][4];
#pragma unroll
  for (int i = 0; i < C::kWarpTiles; ++i) {
    const int kt = warp + kAttnWarps * i;
    float c[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    if (kt < tiles) {
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int j = kt * 16 + nt * 8 + (lane & 7);  // this lane's ldmatrix row: slot j, piece 4 k4 + lane / 8
#pragma unroll
        for (int k4 = 0; k4 < C::kPieces / 4; ++k4) {
          uint32_t bf[4];
          ldmatrix_x4(bf, kb + at(j, 4 * k4 + (lane >> 3)));
          const uint32_t a0[4] = {qa[2 * k4][0], 0u, qa[2 * k4][1], 0u};
          const uint32_t a1[4] = {qa[2 * k4 + 1][0], 0u, qa[2 * k4 + 1][1], 0u};
          mma_bf16(c[nt], a0, bf[0], bf[1]);
          mma_bf16(c[nt], a1, bf[2], bf[3]);
        }
      }
    }
    sv[i][0] = c[0][0];
    sv[i][1] = c[0][1];
    sv[i][2] = c[1][0];
    sv[i][3] = c[1][1];
  }
  // softmax over the warp's slots for head g (log2 units)
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < C::kWarpTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sv[i][e] = (live >> (4 * i + e)) & 1u ? sv[i][e] * scale_log2 : -INFINITY;
      m = fmaxf(m, sv[i][e]);
    }
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
  m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
  float l = 0.f;
#pragma unroll
  for (int i = 0; i < C::kWarpTiles; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sv[i][e] = m == -INFINITY ? 0.f : exp2f(sv[i][e] - m);
      l += sv[i][e];
    }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);
  cp_async_wait<0>();
  if (late_trigger) qerl_pdl::trigger();
  __syncwarp();  // (the warp's V rows)
  float o[C::kNT][4];
#pragma unroll
  for (int nt = 0; nt < C::kNT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[nt][e] = 0.f;
#pragma unroll
  for (int i = 0; i < C::kWarpTiles; ++i) {
    const int kt = warp + kAttnWarps * i;
    if (kt < tiles) {
      uint32_t hi[4], lo[4];
      hi[0] = pack_bf16(sv[i][0], sv[i][1]);
      hi[2] = pack_bf16(sv[i][2], sv[i][3]);
      hi[1] = hi[3] = lo[1] = lo[3] = 0u;
      {
        const __nv_bfloat162 h0 = *reinterpret_cast<const __nv_bfloat162*>(&hi[0]);
        const __nv_bfloat162 h2 = *reinterpret_cast<const __nv_bfloat162*>(&hi[2]);
        lo[0] = pack_bf16(sv[i][0] - __low2float(h0), sv[i][1] - __high2float(h0));
        lo[2] = pack_bf16(sv[i][2] - __low2float(h2), sv[i][3] - __high2float(h2));
      }
      // this lane's ldmatrix.trans row: slot 16 kt + 8 ((lane >> 3) & 1) + (lane & 7), piece 2 d2 + lane / 16
      const int j = kt * 16 + 8 * ((lane >> 3) & 1) + (lane & 7);
#pragma unroll
      for (int d2 = 0; d2 < C::kNT / 2; ++d2) {
        uint32_t bf[4];
        ldmatrix_x4_trans(bf, vb + at(j, 2 * d2 + (lane >> 4)));
        mma_bf16(o[2 * d2], hi, bf[0], bf[1]);
        mma_bf16(o[2 * d2], lo, bf[0], bf[1]);
        mma_bf16(o[2 * d2 + 1], hi, bf[2], bf[3]);
        mma_bf16(o[2 * d2 + 1], lo, bf[2], bf[3]);
      }
    }
  }
  // the warp's partial into its first K tile (rows 16 w ... 16 w + 15: read only by this warp): [8][D] fp32
  __syncwarp();
  float* wo = reinterpret_cast<float*>(kbuf + warp * 16 * (2 * D));
#pragma unroll
  for (int nt = 0; nt < C::kNT; ++nt)
    *reinterpret_cast<float2*>(wo + g * D + 8 * nt + 2 * t) = make_float2(o[nt][0], o[nt][1]);
  if (t == 0) {
    wm[warp][g] = m;
    wl[warp][g] = l;
  }
  __syncthreads();
  // the block's partial: warps added in warp order, weighted exp2(m_w - m_b)
  if (tid < kAttnMaxGroup) {
    float mb = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) mb = fmaxf(mb, wm[w][tid]);
    float lb = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float e = wm[w][tid] == -INFINITY ? 0.f : exp2f(wm[w][tid] - mb);
      we[w][tid] = e;
      lb = fmaf(e, wl[w][tid], lb);
    }
    m_s[tid] = tid < group ? mb : -INFINITY;
    l_s[tid] = tid < group ? lb : 0.f;
  }
  __syncthreads();
  const int outs = group * D;
  bf16* op = out + (pair * group) * D;  // [B, H * D]: the heads kvh * G ... of row bi
  auto block_sum = [&](int idx) {
    const int h = idx / D, d = idx % D;
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w)
      s = fmaf(we[w][h], reinterpret_cast<const float*>(kbuf + w * 16 * (2 * D))[h * D + d], s);
    return s;
  };
  if (splits == 1) {
    for (int idx = tid; idx < outs; idx += kAttnThreads) op[idx] = b(block_sum(idx) / l_s[idx / D]);  // l > 0
    return;
  }
  // the split partial: o[8][D] (unnormalized, relative to m), m[8], l[8]; in a cluster it stays in this block's V
  // buffer, else it goes to the workspace
  float* mine = in_cluster ? vbuf : ws + (pair * splits + split) * kAttnRecord;
  for (int idx = tid; idx < outs; idx += kAttnThreads) mine[idx] = block_sum(idx);
  if (tid < kAttnMaxGroup) {
    mine[kAttnMaxGroup * 128 + tid] = m_s[tid];
    mine[kAttnMaxGroup * 128 + kAttnMaxGroup + tid] = l_s[tid];
  }
  // the split weights exp2(m_s - M) and 1 / sum_s exp2(m_s - M) l_s per head, from every split's m and l in
  // mls[s][16] (loaded by the caller): the same formula for both reductions
  __shared__ float wsplit[kAttnMaxCluster][kAttnMaxGroup];
  auto split_weights = [&](const float* mls, float* wout) {
    if (tid < group) {
      float mx = -INFINITY;
      for (int s = 0; s < splits; ++s) mx = fmaxf(mx, mls[s * 16 + tid]);
      float den = 0.f;
      for (int s = 0; s < splits; ++s) {
        const float ms = mls[s * 16 + tid];
        const float w = ms == -INFINITY ? 0.f : exp2f(ms - mx);
        wout[s * kAttnMaxGroup + tid] = w;
        den += w * mls[s * 16 + kAttnMaxGroup + tid];
      }
      m_s[tid] = 1.f / den;  // den > 0: the split holding the step's own slot has l >= 1
    }
  };
  if (in_cluster) {
    cluster_sync_all();  // every split's partial is in its block's shared memory
    const uint32_t local = static_cast<uint32_t>(__cvta_generic_to_shared(vbuf));
    __shared__ float mls_c[kAttnMaxCluster * 16];
    if (tid < splits * 16)
      mls_c[tid] = ld_cluster_f32(cluster_map(local, tid >> 4) + 4u * (kAttnMaxGroup * 128 + (tid & 15)));
    __syncthreads();
    split_weights(mls_c, &wsplit[0][0]);
    __syncthreads();
    uint32_t base[kAttnMaxCluster];
#pragma unroll
    for (int s = 0; s < kAttnMaxCluster; ++s) base[s] = s < splits ? cluster_map(local, s) : 0u;
    const int per = (outs + splits - 1) / splits;
    const int hi_idx = min(outs, (split + 1) * per);
    for (int idx = split * per + tid; idx < hi_idx; idx += kAttnThreads) {
      float p[kAttnMaxCluster];
#pragma unroll
      for (int s = 0; s < kAttnMaxCluster; ++s)  // all loads in flight before the ordered sum
        if (s < splits) p[s] = ld_cluster_f32(base[s] + 4u * idx);
      const int h = idx / D;
      float acc = 0.f;
#pragma unroll
      for (int s = 0; s < kAttnMaxCluster; ++s)
        if (s < splits) acc = fmaf(wsplit[s][h], p[s], acc);
      op[idx] = b(acc * m_s[h]);
    }
    cluster_sync_all();  // keep this block's partial alive until every remote read of it is done
    return;
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) last_s = atomicAdd(tickets + pair, 1) == splits - 1;
  __syncthreads();
  if (!last_s) return;
  __threadfence();
  const float* all = ws + pair * splits * kAttnRecord;
  // every split's m and l into shared memory with independent loads (a loop of dependent L2 reads here cost about
  // 0.3 us per split, gpu_session part 38), then the weights into the V buffer after them
  float* mls = vbuf;                                     // [splits][16]: m[8], l[8]
  float* wsp = vbuf + kAttnMaxSplits * 16;               // [splits][8]
  for (int i = tid; i < splits * 16; i += kAttnThreads)
    mls[i] = __ldcg(all + (i >> 4) * kAttnRecord + kAttnMaxGroup * 128 + (i & 15));
  __syncthreads();
  split_weights(mls, wsp);
  __syncthreads();
  // each thread's outputs tid, tid + 128, ...: one split's loads for all of them in flight together, the splits
  // added in split order (the cluster's order)
  constexpr int kPer = kAttnMaxGroup * 128 / kAttnThreads;
  float accs[kPer];
#pragma unroll
  for (int k = 0; k < kPer; ++k) accs[k] = 0.f;
#pragma unroll 2
  for (int sp = 0; sp < splits; ++sp) {
    const float* src = all + sp * kAttnRecord;
#pragma unroll
    for (int k = 0; k < kPer; ++k) {
      const int idx = tid + k * kAttnThreads;
      if (idx < outs) accs[k] = fmaf(wsp[sp * kAttnMaxGroup + idx / D], __ldcg(src + idx), accs[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < kPer; ++k) {
    const int idx = tid + k * kAttnThreads;
    if (idx < outs) op[idx] = b(accs[k] * m_s[idx / D]);
  }
  if (tid == 0) tickets[pair] = 0;  // for the next launch (graph replays included)
}
