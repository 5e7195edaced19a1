// Stochastic rounding of FP32 to FP16 and BF16, for the host and the device.
//
// A value x between neighbours a < b of the target format becomes b with probability (x - a) / (b - a)
// and a otherwise, so the rounding is unbiased: E[round(x)] = x. `r` holds 16 uniform random bits in its
// top half (core/philox.h's philox_word; the low half is ignored); the functions are pure, so the same
// (x, r) gives the same bits on every backend.
//
//   - Values on the grid (every FP16/BF16 value, zeros of both signs) pass through unchanged.
//   - Resolution: BF16 compares the 16 dropped bits of x with the 16 random bits, so its probabilities
//     are exact. FP16 drops 13 bits in its normal range (exact too); on its subnormal grid the dropped
//     part can be longer, and only its first 16 bits count: the probability is then exact to 2^-16
//     (rounded down to a multiple of 2^-16; exact for every |x| that is a multiple of 2^-40).
//   - Subnormal targets: the grid below the smallest normal is the subnormal grid (2^-24 for FP16,
//     2^-133 for BF16), and x rounds between its two subnormal (or zero) neighbours the same way.
//   - Overflow: the grid continues one step past the largest finite value, to 2^16 (FP16) or 2^128 (BF16),
//     and that step is infinity. So x above the largest finite value m becomes inf with probability
//     (|x| - m) / (2^emax+1 - m), and |x| >= 2^16 (FP16) is always inf. Saturating instead would hide an
//     overflow from a loss scaler; round-to-nearest sends the same inputs to inf too.
//   - inf stays inf; NaN stays NaN (the same NaN bits as the round-to-nearest conversion gives).
#pragma once

#include <cmath>
#include <cstdint>

#include "numeric.h"

namespace mpf {

enum class Rounding : int32_t { kNearest = 0, kStochastic = 1 };  // numbering: part of the kernel ABI

MPF_HD uint16_t float_to_bf16_bits_sr(float f, uint32_t r) {
  const uint32_t u = float_as_bits(f);
  // Adding 16 random bits to the 16 bits that are dropped carries into the kept half with probability
  // (dropped / 2^16): exactly the distance to the lower neighbour over the step (bit patterns of one sign
  // are ordered like their values, across binades and into inf).
  const uint32_t rounded = (u + (r >> 16)) >> 16;
  return static_cast<uint16_t>(select_bits((u & 0x7fffffffu) > 0x7f800000u, 0x7FC0u, rounded));
}

// Integer operations only, with no FP16 conversion at the end: the CPU loops vectorise it whole.
MPF_HD uint16_t float_to_f16_bits_sr(float f, uint32_t r) {
  const uint32_t u = float_as_bits(f);
  const uint32_t a = u & 0x7fffffffu;
  // FP16's normal range (|x| >= 2^-14): FP16 keeps 10 of FP32's 23 mantissa bits. Adding 13 random bits
  // to the 13 dropped ones carries into the kept part with probability dropped / 2^13, exactly; then the
  // exponent is rebiased (127 -> 15). A carry out of the largest binade lands on 2^16, which FP16 cannot
  // hold, and so does every |x| >= 2^16: inf (0x7C00, the clamp), inf itself included.
  const uint32_t t = (a + (r >> 19)) & 0xFFFFE000u;
  uint32_t normal = (t >> 13) - (112u << 10);  // wraps for |x| < 2^-14, where it is not used
  normal = normal < 0x7C00u ? normal : 0x7C00u;
  // Subnormal range: |x| in units of 2^-40 (16 bits below FP16's subnormal step 2^-24; truncated: the
  // scaling is exact and the conversion truncates), plus 16 random bits, then the whole steps, which are
  // the FP16 bit pattern itself (1024 = 0x400 is 2^-14, the smallest normal). The clamp to 2^-14 is on the
  // bit pattern (an integer compare vectorises where a float one does not) and keeps the conversion in range.
  const uint32_t as = a < 0x38800000u ? a : 0x38800000u;
  const uint32_t n40 = static_cast<uint32_t>(static_cast<int32_t>(bits_as_float(as) * 0x1p40f));
  const uint32_t sub = (n40 + (r >> 16)) >> 16;
  uint32_t mag = select_bits(a >= 0x38800000u, normal, sub);
  mag = select_bits(a > 0x7f800000u, 0x7E00u, mag);  // NaN: the quiet NaN of float_to_f16_bits
  return static_cast<uint16_t>(((u >> 16) & 0x8000u) | mag);
}

// FP16's normal range in fewer operations, for loops that round many values of one kind (an optimizer's
// weights): where f16_sr_normal_range(x) (|x| >= 2^-14: normal, too large or inf; not NaN, not tiny, not
// zero), rounding f16_sr_normal_input(u, r) (u: the bits of x) to FP16 to nearest gives
// float_to_f16_bits_sr(x, r), sign included. The 13 random bits are added to the 13 that FP16 drops and
// those are cleared, so the float lies on FP16's grid (the conversion is exact) or is 2^16 or more (inf, as
// the general formula's clamp); inf stays inf (adding fewer than 2^13 to 0x7f800000 and clearing the low 13
// bits gives it back). The CUDA optimizer's write-back (cuda/optim.cu) takes it for a whole vector when
// every element is in that range (a float compare of |x|: one instruction an element); the avx2/avx512
// loops (cpu/philox_blocks.inc) do the same with integer compares.
MPF_HD bool f16_sr_normal_range(float x) { return fabsf(x) >= 0x1p-14f; }  // false for NaN
MPF_HD float f16_sr_normal_input(uint32_t u, uint32_t r) { return bits_as_float((u + (r >> 19)) & 0xFFFFE000u); }

template <DType D>
MPF_HD uint16_t float_to_bits_sr(float f, uint32_t r) {
  static_assert(D == DType::kFloat16 || D == DType::kBFloat16, "stochastic rounding narrows to FP16 or BF16");
  if constexpr (D == DType::kFloat16) return float_to_f16_bits_sr(f, r);
  else return float_to_bf16_bits_sr(f, r);
}

}  // namespace mpf
