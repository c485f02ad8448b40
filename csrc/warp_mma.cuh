// Warp-level tensor-core and thread-block-cluster primitives shared by both qerl extensions (the NVFP4 kernel's
// small-M path and the decode-attention kernel): mma.sync m16n8k16 on bf16 with fp32 accumulation, ldmatrix
// (plain and transposed), and the sm_90 cluster barrier and distributed-shared-memory loads.
#pragma once

#include <cstdint>
#include <cuda_runtime.h>

// c[0..3] += A (16 x 16, row-major fragment a[0..3]) * B (16 x 8, column-major fragment b0, b1)
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// four 8 x 8 b16 matrices; lanes 8q ... 8q + 7 give the row addresses of matrix q (shared-memory addresses)
__device__ __forceinline__ void ldmatrix_x4(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// the same, each matrix transposed on the way (a row-major [k][n] tile read as the column-major B fragment)
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t* r, uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// every thread of every CTA of the cluster arrives, then waits: shared-memory writes before it are visible to
// the cluster's remote reads after it (sm_90). The three cluster helpers trap in a build for an older
// architecture (the hosts launch clusters only where the sm_90 code runs): never a silent wrong result
__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
}

// this CTA's rank in its cluster, and the cluster's CTA count (0 and 1 outside an sm_90 build)
__device__ __forceinline__ int cluster_rank() {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
  return (int)r;
}
__device__ __forceinline__ int cluster_size() {
  uint32_t n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
  return (int)n;
}

// the address of this CTA's shared-memory word `local` in the shared memory of cluster rank `rank`
__device__ __forceinline__ uint32_t cluster_map(uint32_t local, int rank) {
  uint32_t r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(local), "r"(rank));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return r;
}

__device__ __forceinline__ float ld_cluster_f32(uint32_t addr) {
  float v = 0.f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr));
#elif defined(__CUDA_ARCH__)
  __trap();
#endif
  return v;
}
