// Programmatic dependent launch (PDL, compute capability 9.0+) for the kernels of both qerl extensions.
//
// A kernel launched through qerl_pdl::launch may start while the kernel before it on the stream is still
// running, as soon as every block of that one has called trigger() (or exited). Its blocks then run their
// prologue (index math, shared-memory setup, L2 prefetches and first register loads of the packed weight, the
// LoRA factors' loads) and must call wait() before
// they read anything an earlier kernel wrote or write anything at all: wait() returns once every earlier grid
// has completed and its memory is visible. Before wait() only work that is correct whatever the earlier
// kernels do is allowed: a prefetch into L2 is a hint (L2 is the point of coherence, so a later write by the
// earlier kernel is still what the real load after wait() sees), and a real load only of data that no kernel
// calling trigger() writes. Such a kernel overlaps only kernels launched after its trigger(), and one that never
// calls it (every torch kernel, every copy) completes before its successor starts, hence before anything later
// starts: the LoRA factors and the packed weights (written by torch ops and copies, never by a qerl kernel) are
// safe to load before the wait.
// Kernels launched without the attribute (or by torch) order as usual; in code built for an architecture before
// sm_90 both calls compile to nothing, and launch() leaves the attribute off wherever that code is what runs
// (device_supports). QERL_PDL=0 turns the attribute off everywhere.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cuda_runtime.h>
#include <utility>

namespace qerl_pdl {

__device__ __forceinline__ void trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// L2 prefetch of [p, p + bytes): bytes a multiple of 16, p 16-byte aligned (sm_90 bulk prefetch; nothing before)
__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (bytes) asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

#ifndef QERL_NO_TORCH
// per process: QERL_PDL=0 turns it off; set_enabled() (tests, benchmarks) overrides
inline int& enabled_flag() {
  static int v = [] {
    const char* e = std::getenv("QERL_PDL");
    return (e && e[0] == '0') ? 0 : 1;
  }();
  return v;
}

// an empty kernel built with this extension's own arch flags (device_supports asks which code of it a device runs)
static __global__ void sm90_probe_kernel() {}

// whether this extension's sm_90 code runs on device dev: compute capability 9 or newer, and a binary built for
// sm_90 or from compute_90 PTX or newer. A newer GPU running the compute_80 PTX (no exact cubin among the default
// arch flags) has trigger(), wait() and the cluster instructions compiled to nothing: it gets neither PDL nor
// clusters (review, session 18: the decode-attention cluster path would have written NaN there)
inline bool device_supports(int dev) {
  static int ok[64] = {0};  // 0: not asked yet, 1 / -1 (benign race: every writer stores the same value)
  if (dev < 0 || dev >= 64) return false;
  if (ok[dev] == 0) {
    int major = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    bool yes = major >= 9;
    if (yes) {
      int cur = 0;
      cudaGetDevice(&cur);
      if (cur != dev) cudaSetDevice(dev);
      cudaFuncAttributes fa{};
      if (cudaFuncGetAttributes(&fa, sm90_probe_kernel) != cudaSuccess) {
        (void)cudaGetLastError();  // (this query's own error: no sm_90 features then)
        yes = false;
      } else {
        yes = fa.binaryVersion == 90 || fa.ptxVersion >= 90;
      }
      if (cur != dev) cudaSetDevice(cur);
    }
    ok[dev] = yes ? 1 : -1;
  }
  return ok[dev] > 0;
}

// kern<<<grid, block, smem, stream>>>(args...), with the PDL attribute where enabled and supported, and as
// thread-block clusters of cluster.x * cluster.y * cluster.z CTAs when that is more than 1 (the caller checks
// device_supports)
template <typename... KArgs, typename... Args>
cudaError_t launch_cluster_dims(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                                int dev, dim3 cluster, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (enabled_flag() && device_supports(dev)) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster.x;
    attr[n].val.clusterDim.y = cluster.y;
    attr[n].val.clusterDim.z = cluster.z;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kern, std::forward<Args>(args)...);
}

// the same with clusters of cluster_z CTAs along z
template <typename... KArgs, typename... Args>
cudaError_t launch_clustered(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             int dev, unsigned cluster_z, Args&&... args) {
  return launch_cluster_dims(kern, grid, block, smem, stream, dev, dim3(1, 1, cluster_z),
                             std::forward<Args>(args)...);
}

template <typename... KArgs, typename... Args>
cudaError_t launch(void (*kern)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream, int dev,
                   Args&&... args) {
  return launch_clustered(kern, grid, block, smem, stream, dev, 1u, std::forward<Args>(args)...);
}
#endif

}  // namespace qerl_pdl
