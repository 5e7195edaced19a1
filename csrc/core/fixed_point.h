// Fixed-point numbers <IL, FL> after Gupta, Agrawal, Gopalakrishnan and Narayanan, "Deep Learning with
// Limited Numerical Precision" (ICML 2015), for the host and the device.
//
// A number of <IL, FL> is a signed integer code c of WL = IL + FL bits (two's complement) standing for
// the value c * 2^-FL: the grid step is eps = 2^-FL and the range [-2^(IL-1), 2^(IL-1) - eps]. The paper's
// Convert(x, <IL, FL>) saturates x to that range, then rounds it to the grid:
//   - nearest (the paper's definition): floor(x) if x <= floor(x) + eps/2, else floor(x) + eps, where
//     floor rounds towards -inf on the grid. Ties therefore go DOWN (towards -inf), for both signs.
//   - stochastic: floor(x) + eps with probability (x - floor(x)) / eps, else floor(x), on the signed value.
//     The comparison takes the element's 16 random bits (core/philox.h: the top half of r, the low half
//     zero): up when r < (x - floor(x)) / eps * 2^32. The probability is exactly (x - floor(x)) / eps
//     when that fraction is a multiple of 2^-16, and within 2^-16 above it otherwise (it is
//     ceil(frac * 2^16) / 2^16).
//   - inf saturates like any large value; NaN becomes the code 0 (a fixed-point word has no NaN; 0 adds
//     nothing to a MACC's sum; detect NaNs beforehand, e.g. with mpfused.non_finite_check_).
// Everything is computed in double: x * 2^FL is exact for every float32 (and float16/bfloat16) input,
// and so is its fractional part, so the rounding decision is made on the exact value.
//
// The MACC (fixed_round_shift): products of codes summed exactly in int64, the sum (a code with
// FLa + FLb fractional bits) rounded ONCE into the output format by the same nearest/stochastic rule,
// in integer arithmetic, then saturated.
#pragma once

#include <cstdint>
#include <type_traits>

#include "numeric.h"
#include "stochastic.h"  // Rounding

namespace mpf {

constexpr int kFixedMaxWordLength = 32;      // codes are at most int32
constexpr int kFixedMaxFractionalBits = 31;  // eps >= 2^-31

// The element types of the fixed-point kernels: codes (int16, int32) and values (float32, float64; float16
// and bfloat16 as inputs). The numbering is part of the kernel ABI (kernels.h).
enum class FixedType : int32_t { kInt16 = 0, kInt32 = 1, kFloat32 = 2, kFloat64 = 3, kFloat16 = 4, kBFloat16 = 5 };

template <FixedType T>
struct FixedElem;
template <>
struct FixedElem<FixedType::kInt16> {
  using type = int16_t;
  static constexpr bool is_code = true;
};
template <>
struct FixedElem<FixedType::kInt32> {
  using type = int32_t;
  static constexpr bool is_code = true;
};
template <>
struct FixedElem<FixedType::kFloat32> {
  using type = float;
  static constexpr bool is_code = false;
  static MPF_HD double load(float x) { return static_cast<double>(x); }
};
template <>
struct FixedElem<FixedType::kFloat64> {
  using type = double;
  static constexpr bool is_code = false;
  static MPF_HD double load(double x) { return x; }
};
template <>
struct FixedElem<FixedType::kFloat16> {
  using type = uint16_t;
  static constexpr bool is_code = false;
  static MPF_HD double load(uint16_t x) { return static_cast<double>(f16_bits_to_float(x)); }
};
template <>
struct FixedElem<FixedType::kBFloat16> {
  using type = uint16_t;
  static constexpr bool is_code = false;
  static MPF_HD double load(uint16_t x) { return static_cast<double>(bf16_bits_to_float(x)); }
};

template <FixedType T>
using FixedTypeConst = std::integral_constant<FixedType, T>;

// f(FixedTypeConst<t>{}) for a code type (int16, int32).
template <class F>
inline void dispatch_code_type(FixedType t, F&& f) {
  if (t == FixedType::kInt16) f(FixedTypeConst<FixedType::kInt16>{});
  else f(FixedTypeConst<FixedType::kInt32>{});
}

// f(FixedTypeConst<t>{}) for an input value type (float32, float64, float16, bfloat16).
template <class F>
inline void dispatch_value_type(FixedType t, F&& f) {
  switch (t) {
    case FixedType::kFloat64: f(FixedTypeConst<FixedType::kFloat64>{}); return;
    case FixedType::kFloat16: f(FixedTypeConst<FixedType::kFloat16>{}); return;
    case FixedType::kBFloat16: f(FixedTypeConst<FixedType::kBFloat16>{}); return;
    default: f(FixedTypeConst<FixedType::kFloat32>{}); return;
  }
}

// f(FixedTypeConst<t>{}) for an output type of Convert (int16, int32, float32, float64).
template <class F>
inline void dispatch_out_type(FixedType t, F&& f) {
  switch (t) {
    case FixedType::kInt16: f(FixedTypeConst<FixedType::kInt16>{}); return;
    case FixedType::kInt32: f(FixedTypeConst<FixedType::kInt32>{}); return;
    case FixedType::kFloat64: f(FixedTypeConst<FixedType::kFloat64>{}); return;
    default: f(FixedTypeConst<FixedType::kFloat32>{}); return;
  }
}

// A format <IL, FL> as the kernels use it: the code range and the scale 2^FL.
struct FixedFormat {
  int32_t il;  // integer bits, sign included: >= 1
  int32_t fl;  // fractional bits: >= 0; il + fl <= 32
};

MPF_HD int32_t fixed_wl(FixedFormat f) { return f.il + f.fl; }
MPF_HD int64_t fixed_code_min(FixedFormat f) { return -(int64_t{1} << (fixed_wl(f) - 1)); }
MPF_HD int64_t fixed_code_max(FixedFormat f) { return (int64_t{1} << (fixed_wl(f) - 1)) - 1; }

// 2^e for 0 <= e <= 62 (or negative e down to -62), exactly, as a double.
MPF_HD double pow2(int e) {
  return e >= 0 ? static_cast<double>(uint64_t{1} << e) : 1.0 / static_cast<double>(uint64_t{1} << -e);
}

// The per-call constants of Convert: computed once on the host, passed by value to every element.
struct FixedQuant {
  double scale;      // 2^FL
  double inv_scale;  // 2^-FL
  double lo, hi;     // the code range, as doubles (exact: |code| <= 2^31)
};

MPF_HD FixedQuant fixed_quant(FixedFormat f) {
  return FixedQuant{pow2(f.fl), pow2(-f.fl), static_cast<double>(fixed_code_min(f)),
                    static_cast<double>(fixed_code_max(f))};
}

// 2^32 as a double: the scale of r (its 16 random bits are its top half).
constexpr double kTwo32 = 4294967296.0;

// Convert(x, <IL, FL>) as a code. `r`: the random bits (top 16), read only when `mode` is stochastic.
// Branch-free (selects), so host loops over it vectorise.
MPF_HD int32_t fixed_code(double x, const FixedQuant& q, Rounding mode, uint32_t r) {
  double v = x * q.scale;   // exact (a power-of-two scaling of a float32/float64 value in range)
  v = v == v ? v : 0.0;     // NaN -> 0
  v = v < q.lo ? q.lo : v;  // saturate (inf included); the bounds are integers, so rounding stays inside
  v = v > q.hi ? q.hi : v;
  const int32_t t = static_cast<int32_t>(v);           // towards zero; |v| <= 2^31 fits
  const int32_t n = t - (v < static_cast<double>(t));  // floor
  const double frac = v - static_cast<double>(n);      // exact, in [0, 1)
  const bool up = mode == Rounding::kNearest ? frac > 0.5 : static_cast<double>(r) < frac * kTwo32;
  return n + static_cast<int32_t>(up);  // frac > 0 means n < hi: no overflow past the range
}

// Convert in FP32 arithmetic, for FP32 values (float32, float16, bfloat16 inputs) in a format of WL <= 24:
// every quantity fixed_code computes in double is then exact in FP32 as well (x * 2^FL is a power-of-two
// scaling, or overflows to inf and saturates; the code range lies within 2^23; the fraction is exact),
// and the stochastic test is the same comparison on r's 16 random bits. So it gives fixed_code's codes,
// with vectors twice as wide on the CPU and no FP64 on the GPU.
struct FixedQuantF {
  float scale, inv_scale, lo, hi;
};

MPF_HD bool fixed_float_math(FixedFormat f) { return fixed_wl(f) <= 24; }

MPF_HD FixedQuantF fixed_quant_f(FixedFormat f) {
  const FixedQuant q = fixed_quant(f);
  return FixedQuantF{static_cast<float>(q.scale), static_cast<float>(q.inv_scale), static_cast<float>(q.lo),
                     static_cast<float>(q.hi)};
}

MPF_HD int32_t fixed_code_f(float x, const FixedQuantF& q, Rounding mode, uint32_t r) {
  float v = x * q.scale;  // exact, or +-inf (saturated below)
  v = v == v ? v : 0.0f;  // NaN -> 0
  v = v < q.lo ? q.lo : v;
  v = v > q.hi ? q.hi : v;
  const int32_t t = static_cast<int32_t>(v);  // |v| <= 2^23
  const int32_t n = t - (v < static_cast<float>(t));
  const float frac = v - static_cast<float>(n);
  const bool up = mode == Rounding::kNearest ? frac > 0.5f
                                             : static_cast<float>(static_cast<int32_t>(r >> 16)) < frac * 65536.0f;
  return n + static_cast<int32_t>(up);
}

// Convert(x) as a value on the grid (code * 2^-FL, exact in double).
MPF_HD double fixed_value(double x, const FixedQuant& q, Rounding mode, uint32_t r) {
  return static_cast<double>(fixed_code(x, q, mode, r)) * q.inv_scale;
}

// A code stored as element type D: the code itself (int16/int32), or its value (float32: exact for
// WL <= 24, the caller's rule; float64: exact). Q: FixedQuant, or FixedQuantF (then WL <= 24).
template <FixedType D, class Q>
MPF_HD typename FixedElem<D>::type fixed_store(int32_t code, const Q& q) {
  using T = typename FixedElem<D>::type;
  if constexpr (FixedElem<D>::is_code) return static_cast<T>(code);
  else if constexpr (D == FixedType::kFloat32 && std::is_same_v<Q, FixedQuantF>)
    return static_cast<float>(code) * q.inv_scale;  // exact: |code| < 2^24, a power-of-two scale
  else return static_cast<T>(static_cast<double>(code) * static_cast<double>(q.inv_scale));
}

// The FP32 value of an input element (float32, float16, bfloat16), for fixed_code_f.
template <FixedType S>
MPF_HD float fixed_load_f(typename FixedElem<S>::type x) {
  if constexpr (S == FixedType::kFloat32) return x;
  else if constexpr (S == FixedType::kFloat16) return f16_bits_to_float(x);
  else return bf16_bits_to_float(x);
}

// The per-call constants of the MACC's final rounding.
struct FixedShift {
  int32_t shift;   // FLa + FLb - FLout: the fractional bits the sum has beyond the output's (may be < 0)
  int64_t lo, hi;  // the output's code range
};

// An exact sum `acc` of code products (|acc| <= 2^62) rounded into the output format: acc * 2^-shift
// rounded to an integer by the nearest (ties down) or stochastic rule of fixed_code, then saturated.
// The stochastic rule is the same comparison as fixed_code's: up when r < rem / 2^shift * 2^32, made
// exact in integers (r < ceil(rem * 2^(32 - shift))); with r's 16 random bits the probability is exact
// for shift <= 16 and within 2^-16 above it otherwise.
MPF_HD int32_t fixed_round_shift(int64_t acc, const FixedShift& s, Rounding mode, uint32_t r) {
  if (s.shift <= 0) {  // more fractional bits in the output than in the sum: exact, only saturation
    acc = acc < s.lo ? s.lo : acc > s.hi ? s.hi : acc;  // |acc| <= 2^31 now; shift <= 31 keeps it < 2^63
    const int64_t v = static_cast<int64_t>(static_cast<uint64_t>(acc) << -s.shift);
    return static_cast<int32_t>(v < s.lo ? s.lo : v > s.hi ? s.hi : v);
  }
  const int64_t n = acc >> s.shift;  // floor (arithmetic shift)
  const uint64_t rem = static_cast<uint64_t>(acc) & ((uint64_t{1} << s.shift) - 1);  // acc - n * 2^shift
  bool up;
  if (mode == Rounding::kNearest) {
    up = rem > (uint64_t{1} << (s.shift - 1));
  } else if (s.shift <= 32) {
    up = static_cast<uint64_t>(r) < (rem << (32 - s.shift));
  } else {
    const int drop = s.shift - 32;
    up = static_cast<uint64_t>(r) < ((rem + (uint64_t{1} << drop) - 1) >> drop);
  }
  const int64_t v = n + static_cast<int64_t>(up);
  return static_cast<int32_t>(v < s.lo ? s.lo : v > s.hi ? s.hi : v);
}

// Whether a MACC of depth k over formats of word lengths wla and wlb stays exact in int64: every product
// is at most 2^(wla + wlb - 2) in magnitude, so the sum is at most k * 2^(wla + wlb - 2); it must be at
// most 2^62 (one bit below int64's limit, which the final rounding's arithmetic keeps free):
// wla + wlb + ceil(log2 k) <= 64.
MPF_HD int fixed_ceil_log2(int64_t k) {
  int c = 0;
  while (c < 63 && (int64_t{1} << c) < k) ++c;
  return c;
}
MPF_HD bool fixed_macc_fits(int wla, int wlb, int64_t k) { return wla + wlb + fixed_ceil_log2(k) <= 64; }

// The MACC of int16 codes on integer tensor cores (cuda/fixed_point.cu), which multiply 8-bit digits: a code x
// is biased to the unsigned u = x + 2^15 (the same bits with the top one flipped), u = 2^8 hi + lo with digits
// hi, lo in [0, 255], and for each output
//   S = sum_k a_u b_u = 2^16 sum(hi_a hi_b) + 2^8 sum(hi_a lo_b + lo_a hi_b) + sum(lo_a lo_b)
// of three sums of digit products, which the units accumulate in int32: a digit product is at most
// 255^2 = 65025, so the middle sum, two a step, stays below 2^31 over kFixedDigitSpan steps, and the kernel
// moves the three into 64 bits at least that often. Then
//   sum_k a b = sum_k (a_u - 2^15)(b_u - 2^15) = S - 2^15 (sum_k a_u + sum_k b_u) + K 2^30,
// with the sums of a's row and b's column over the K steps. S alone may pass 2^63 (K 2^32 products of up to
// 2^32), so everything is computed modulo 2^64 (unsigned), which gives the exact value: |sum a b| <= K 2^30
// <= 2^62 wherever fixed_macc_fits (16-bit codes: K <= 2^32). A step where both operands are padding
// (k >= K) has digits 0 and adds nothing to S or to the sums.
constexpr int64_t kFixedDigitSpan = 16384;  // 2 * 65025 * 16384 = 2,130,739,200 < 2^31
MPF_HD uint32_t fixed_biased(int16_t code) { return static_cast<uint32_t>(static_cast<uint16_t>(code)) ^ 0x8000u; }
MPF_HD uint64_t fixed_digit_sum(uint64_t hh, uint64_t mid, uint64_t ll) { return (hh << 16) + (mid << 8) + ll; }
MPF_HD int64_t fixed_unbias_sum(uint64_t s, uint64_t sum_a_biased, uint64_t sum_b_biased, uint64_t k) {
  return static_cast<int64_t>(s - ((sum_a_biased + sum_b_biased) << 15) + (k << 30));
}

}  // namespace mpf
