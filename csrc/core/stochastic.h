// Stochastic rounding of FP32 to FP16 and BF16, for the host and the device.
//
// A value x between neighbours a < b of the target format becomes b with probability (x - a) / (b - a)
// and a otherwise, so the rounding is unbiased: E[round(x)] = x. `r` is 32 uniform random bits (core/
// philox.h); the functions are pure, so the same (x, r) gives the same bits on every backend.
//
//   - Values on the grid (every FP16/BF16 value, zeros of both signs) pass through unchanged.
//   - Resolution: BF16 compares the 16 dropped bits of x with 16 random bits, so its probabilities are
//     exact. FP16 compares the dropped part with 24 random bits: exact wherever that part has at most 24
//     bits (every x in FP16's normal range and |x| >= 2^-25), within 2^-24 otherwise.
//   - Subnormal targets: the grid below the smallest normal is the subnormal grid (2^-24 for FP16,
//     2^-133 for BF16), and x rounds between its two subnormal (or zero) neighbours the same way.
//   - Overflow: the grid continues one step past the largest finite value, to 2^16 (FP16) or 2^128 (BF16),
//     and that step is infinity. So x above the largest finite value m becomes inf with probability
//     (|x| - m) / (2^emax+1 - m), and |x| >= 2^16 (FP16) is always inf. Saturating instead would hide an
//     overflow from a loss scaler; round-to-nearest sends the same inputs to inf too.
//   - inf stays inf; NaN stays NaN (the same NaN bits as the round-to-nearest conversion gives).
#pragma once

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

// The FP16 value x rounds to, as an FP32 (exactly representable in FP16, or inf, or NaN): the CPU narrows
// blocks of these with its vector conversion, which is exact on them.
MPF_HD float f16_sr_value(float f, uint32_t r) {
  const uint32_t u = float_as_bits(f);
  const uint32_t a = u & 0x7fffffffu;
  // The FP16 step at |x| is 2^(e - 10) for the unbiased exponent e in [-14, 15], 2^-24 below (subnormals);
  // clamping the biased exponent to [113, 143] gives that, and for |x| >= 2^16 a step whose every multiple
  // at or above |x| is inf in FP16.
  uint32_t e = a >> 23;
  e = e < 113u ? 113u : e;
  e = e > 143u ? 143u : e;
  // |x| in steps (exact: a power-of-two scaling of a finite value), its whole steps and the dropped part.
  float q = bits_as_float(a) * bits_as_float((264u - e) << 23);  // * 2^(10 - (e - 127))
  // inf and huge values (NaN too) to 2^12 steps: inf below. q is +0 or more, or NaN, so its bit pattern orders
  // it: an integer compare, which the CPU loops if-convert and vectorise (a float compare, which may trap, is
  // not if-converted by GCC, and the loop stays scalar).
  q = bits_as_float(select_bits(float_as_bits(q) < 0x45800000u, float_as_bits(q), 0x45800000u));  // 4096.f
  const float whole = static_cast<float>(static_cast<int32_t>(q));
  const float frac = q - whole;  // exact
  const float up = static_cast<float>(r >> 8) < frac * 16777216.f ? 1.f : 0.f;
  const float v = (whole + up) * bits_as_float((e - 10u) << 23);  // back to a value: exact, or >= 2^16
  return bits_as_float(select_bits(a >= 0x7f800000u, u, (u & 0x80000000u) | float_as_bits(v)));  // inf, NaN: x
}

MPF_HD uint16_t float_to_f16_bits_sr(float f, uint32_t r) { return float_to_f16_bits(f16_sr_value(f, r)); }

template <DType D>
MPF_HD uint16_t float_to_bits_sr(float f, uint32_t r) {
  static_assert(D == DType::kFloat16 || D == DType::kBFloat16, "stochastic rounding narrows to FP16 or BF16");
  if constexpr (D == DType::kFloat16) return float_to_f16_bits_sr(f, r);
  else return float_to_bf16_bits_sr(f, r);
}

}  // namespace mpf
