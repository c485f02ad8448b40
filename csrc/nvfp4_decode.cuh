// E2M1 code word -> bf16x2 A-fragment registers, for the record layout "qerl-nvfp4-tile16x64-v2"
// (src/qerl_cli/layout.py places the bits; benchmarks/decode_layout_search.py found the placement).
//
// Register p of a 32-bit code word holds its two codes as bf16 bit patterns of value * 2^-126: sign at bit
// 15 (+16 for the high half), e1 e0 m at bits 8..6 — the bf16 exponent's two low bits and the mantissa's top bit,
// which is exactly the E2M1 value scaled by 2^-126 (the 0.5 subnormal included). The layout puts each code's bits
// where one of these formulas finds them: 8 integer instructions per word (a plain lop3, two funnel-shift + lop3
// pairs, and mask / multiply / mask, whose three shifted copies by 2, 7 and 12 never overlap, so no carries).
// Host and device: tests/test_layout.py runs these very functions on the CPU against the Python packer.
#pragma once

#include <cstdint>

namespace qerl_decode {

constexpr uint32_t kMask = 0x81C081C0u;

__host__ __device__ __forceinline__ uint32_t rotl(uint32_t w, int r) {
#ifdef __CUDA_ARCH__
  return __funnelshift_l(w, w, r);
#else
  return (w << r) | (w >> (32 - r));
#endif
}

template <int P>
__host__ __device__ __forceinline__ uint32_t reg(uint32_t w) {
  if constexpr (P == 0) return w & kMask;
  else if constexpr (P == 1) return rotl(w, 10) & kMask;
  else if constexpr (P == 2) return rotl(w, 13) & kMask;
  else return ((w & 0x001B001Bu) * 0x1084u) & kMask;
}

// the same with p known only after unrolling
__host__ __device__ __forceinline__ uint32_t reg_at(uint32_t w, int p) {
  return p == 0 ? reg<0>(w) : p == 1 ? reg<1>(w) : p == 2 ? reg<2>(w) : reg<3>(w);
}

}  // namespace qerl_decode
