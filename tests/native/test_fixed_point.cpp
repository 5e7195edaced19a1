// Fixed point <IL, FL> (core/fixed_point.h) on hand-computed values: Convert's saturation, the paper's
// nearest rule (ties down), the stochastic comparison, NaN/inf, the MACC's final rounding, and the CPU
// kernels on a small buffer and a 2x2 product.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "kernels.h"

using namespace mpf;

namespace {

int32_t nearest(double x, int il, int fl) { return fixed_code(x, fixed_quant({il, fl}), Rounding::kNearest, 0u); }
int32_t stochastic(double x, int il, int fl, uint32_t r) {
  return fixed_code(x, fixed_quant({il, fl}), Rounding::kStochastic, r);
}

void test_convert() {
  // <4, 2>: eps 0.25, codes [-32, 31], values [-8, 7.75].
  CHECK(nearest(0.125, 4, 2) == 0, "tie 0.125 goes down to 0");
  CHECK(nearest(0.375, 4, 2) == 1, "tie 0.375 goes down to 0.25");
  CHECK(nearest(-0.125, 4, 2) == -1, "tie -0.125 goes down to -0.25");
  CHECK(nearest(0.126, 4, 2) == 1, "above the tie rounds up");
  CHECK(nearest(-0.374, 4, 2) == -1, "-0.374 -> -0.25");
  CHECK(nearest(7.9, 4, 2) == 31 && nearest(100.0, 4, 2) == 31, "saturates at 7.75");
  CHECK(nearest(-8.1, 4, 2) == -32 && nearest(-8.0, 4, 2) == -32, "saturates at -8");
  CHECK(nearest(INFINITY, 4, 2) == 31 && nearest(-INFINITY, 4, 2) == -32, "inf saturates");
  CHECK(nearest(std::nan(""), 4, 2) == 0 && stochastic(std::nan(""), 4, 2, 0u) == 0, "NaN -> 0");
  // Stochastic: x = 0.3125 is 1.25 steps: floor 1, frac 0.25; up when r < 2^30.
  CHECK(stochastic(0.3125, 4, 2, (1u << 30) - 1) == 2, "r just below frac * 2^32 rounds up");
  CHECK(stochastic(0.3125, 4, 2, 1u << 30) == 1, "r at frac * 2^32 rounds down");
  CHECK(stochastic(-0.3125, 4, 2, (3u << 30) - 1) == -1, "signed: -1.25 steps, frac 0.75 from floor -2");
  CHECK(stochastic(-0.3125, 4, 2, 3u << 30) == -2, "signed: r >= 0.75 * 2^32 stays at floor -2");
  CHECK(stochastic(0.5, 4, 2, 0xffffffffu) == 2 && stochastic(0.5, 4, 2, 0u) == 2, "grid values pass through");
  // The widest formats: <1, 31> codes span int32; <32, 0> integers.
  CHECK(nearest(-1.0, 1, 31) == INT32_MIN && nearest(1.0, 1, 31) == INT32_MAX, "<1,31> saturation");
  CHECK(nearest(2147483647.5, 32, 0) == INT32_MAX && nearest(-2.5, 32, 0) == -3, "<32,0>: ties down");
  CHECK(fixed_store<FixedType::kFloat32>(-3, fixed_quant({4, 2})) == -0.75f, "value of code -3 in <4,2>");
}

void test_round_shift() {
  const FixedShift s3{3, -128, 127};  // 3 fractional bits dropped, into 8-bit codes
  CHECK(fixed_round_shift(12, s3, Rounding::kNearest, 0u) == 1, "12/8 = 1.5: tie goes down");
  CHECK(fixed_round_shift(13, s3, Rounding::kNearest, 0u) == 2, "13/8 = 1.625 -> 2");
  CHECK(fixed_round_shift(-12, s3, Rounding::kNearest, 0u) == -2, "-1.5: tie goes down to -2");
  CHECK(fixed_round_shift(-11, s3, Rounding::kNearest, 0u) == -1, "-1.375 -> -1");
  CHECK(fixed_round_shift(5000, s3, Rounding::kNearest, 0u) == 127, "saturates high");
  CHECK(fixed_round_shift(-5000, s3, Rounding::kNearest, 0u) == -128, "saturates low");
  // 10/8 = 1.25: up when r < 0.25 * 2^32.
  CHECK(fixed_round_shift(10, s3, Rounding::kStochastic, (1u << 30) - 1) == 2, "stochastic up");
  CHECK(fixed_round_shift(10, s3, Rounding::kStochastic, 1u << 30) == 1, "stochastic down");
  // shift 40 (> 32): rem = 2^39 + 1 of 2^40, frac just above 1/2: up when r < ceil((2^39 + 1) / 2^8) = 2^31 + 1.
  const FixedShift s40{40, INT32_MIN, INT32_MAX};
  const int64_t acc = (int64_t{5} << 40) + (int64_t{1} << 39) + 1;
  CHECK(fixed_round_shift(acc, s40, Rounding::kStochastic, 1u << 31) == 6, "r = 2^31 < 2^31 + 1: up");
  CHECK(fixed_round_shift(acc, s40, Rounding::kStochastic, (1u << 31) + 1) == 5, "r = 2^31 + 1: down");
  CHECK(fixed_round_shift(acc, s40, Rounding::kNearest, 0u) == 6, "just above the tie: up");
  // Negative shift: more output fractional bits, exact.
  const FixedShift sm2{-2, -128, 127};
  CHECK(fixed_round_shift(-7, sm2, Rounding::kNearest, 0u) == -28 && fixed_round_shift(40, sm2, Rounding::kNearest, 0u) == 127,
        "left shift and saturation");
  CHECK(fixed_macc_fits(16, 16, int64_t{1} << 32) && !fixed_macc_fits(16, 16, (int64_t{1} << 32) + 1), "MACC bound");
  CHECK(fixed_macc_fits(32, 32, 1) && !fixed_macc_fits(32, 32, 2), "MACC bound, widest codes");
}

// The digit form of the int16 MACC (core/fixed_point.h: fixed_biased .. fixed_unbias_sum) against the direct
// int64 sum: random codes and the extremes; and at K = 2^32 (the deepest fixed_macc_fits allows), where S
// passes 2^64 and only its value modulo 2^64 is kept.
void test_digit_form() {
  std::mt19937 rng(5);
  auto digit_dot = [](const std::vector<int16_t>& a, const std::vector<int16_t>& b) {
    uint64_t hh = 0, mid = 0, ll = 0, sa = 0, sb = 0;
    for (size_t k = 0; k < a.size(); ++k) {
      const uint32_t ua = fixed_biased(a[k]), ub = fixed_biased(b[k]);
      hh += (ua >> 8) * (ub >> 8);
      mid += (ua >> 8) * (ub & 255u) + (ua & 255u) * (ub >> 8);
      ll += (ua & 255u) * (ub & 255u);
      sa += ua;
      sb += ub;
    }
    return fixed_unbias_sum(fixed_digit_sum(hh, mid, ll), sa, sb, a.size());
  };
  CHECK(fixed_biased(-32768) == 0u && fixed_biased(0) == 0x8000u && fixed_biased(32767) == 0xffffu && fixed_biased(-1) == 0x7fffu,
        "biased codes");
  for (const int64_t k : {int64_t{1}, int64_t{2}, int64_t{17}, int64_t{1000}, kFixedDigitSpan + 3, int64_t{1} << 20}) {
    for (int pattern = 0; pattern < 5; ++pattern) {
      std::vector<int16_t> a(static_cast<size_t>(k)), b(static_cast<size_t>(k));
      int64_t direct = 0;
      for (int64_t i = 0; i < k; ++i) {
        const int16_t lo = -32768, hi = 32767;
        const int16_t x = pattern == 0 ? lo : pattern <= 2 ? hi : static_cast<int16_t>(rng());
        const int16_t y = pattern == 1 ? lo : pattern <= 2 ? x : static_cast<int16_t>(rng());
        a[static_cast<size_t>(i)] = x;
        b[static_cast<size_t>(i)] = y;
        direct += int64_t{x} * y;
      }
      const int64_t got = digit_dot(a, b);
      CHECK(got == direct, "digit form, K %lld pattern %d: %lld, direct %lld", static_cast<long long>(k), pattern,
            static_cast<long long>(got), static_cast<long long>(direct));
    }
  }
  {
    const uint64_t k = uint64_t{1} << 32, u = 0xffffu;  // every code 32767: S = 2^32 (2^16 - 1)^2 wraps
    const uint64_t s = k * (u * u), sums = k * u;
    CHECK(fixed_unbias_sum(s, sums, sums, k) == (int64_t{32767} * 32767) << 32, "digit form at K = 2^32");
    const uint64_t s_lo = 0;  // every code -32768: u = 0
    CHECK(fixed_unbias_sum(s_lo, 0, 0, k) == int64_t{1} << 62, "digit form at K = 2^32, codes -2^15");
  }
  // The bound the kernel's flushes rely on: the middle sum of kFixedDigitSpan steps of the largest digits.
  CHECK(2ull * 255 * 255 * static_cast<uint64_t>(kFixedDigitSpan) < (1ull << 31), "digit span bound");
  CHECK(2ull * 255 * 255 * static_cast<uint64_t>(2 * kFixedDigitSpan) >= (1ull << 31), "digit span is the largest power of two");
}

void test_cpu_kernels() {
  const float src[5] = {0.125f, -0.125f, 100.f, 0.3f, NAN};
  int16_t codes[5];
  fixed_quantize_cpu(FixedQuantizeArgs{src, FixedType::kFloat32, codes, FixedType::kInt16, 5, {4, 2},
                                       Rounding::kNearest, 0, 0},
                     2);
  CHECK(codes[0] == 0 && codes[1] == -1 && codes[2] == 31 && codes[3] == 1 && codes[4] == 0, "quantize kernel codes");
  // [[1.5, -0.25], [0.75, 2]] @ [[0.5, 1], [-1, 0.25]] in <4, 2> -> <6, 1> (eps 0.5):
  // exact [[1, 1.4375], [-1.625, 1.25]] -> nearest (ties down) [[1, 1.5], [-1.5, 1]] -> codes [[2, 3], [-3, 2]].
  const int16_t a[4] = {6, -1, 3, 8};
  const int32_t b[4] = {2, 4, -4, 1};
  int32_t out[4];
  fixed_matmul_cpu(FixedMatmulArgs{a, FixedType::kInt16, b, FixedType::kInt32, out, FixedType::kInt32, 2, 2, 2,
                                   FixedShift{2 + 2 - 1, -64, 63}, Rounding::kNearest, 0, 0},
                   2);
  CHECK(out[0] == 2 && out[1] == 3 && out[2] == -3 && out[3] == 2, "matmul codes %d %d %d %d", out[0], out[1], out[2],
        out[3]);
}

}  // namespace

int main() {
  test_convert();
  test_round_shift();
  test_digit_form();
  test_cpu_kernels();
  return native_test::finish("test_fixed_point");
}
