// The FP16/BF16 conversions of core/numeric.h against straightforward reference implementations:
// exhaustive for FP16 -> FP32, and for FP32 -> FP16/BF16 at every rounding midpoint (and its float
// neighbours) plus a strided sweep over all 2^32 float bit patterns.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "check.h"
#include "core/master_split.h"
#include "core/numeric.h"

using namespace mpf;

namespace {

double ref_f16_value(uint16_t h) {  // finite halves only
  const int sign = h >> 15, exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  const double mag = exp == 0 ? std::ldexp(mant, -24) : std::ldexp(1024 + mant, exp - 25);
  return sign ? -mag : mag;
}

// Nearest finite FP16 by search over the sorted non-negative halves, ties to the even bit pattern;
// overflow to inf at 65520 (the midpoint between 65504 and 2^16).
std::vector<double> half_values() {
  std::vector<double> v(0x7c00);
  for (uint32_t b = 0; b < 0x7c00; ++b) v[b] = ref_f16_value(static_cast<uint16_t>(b));
  return v;
}

uint16_t ref_float_to_f16(float f, const std::vector<double>& halves) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  if (std::isnan(f)) return 0x7e00;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 65520.0) return sign | 0x7c00;
  const auto it = std::lower_bound(halves.begin(), halves.end(), a);
  const uint32_t hi = static_cast<uint32_t>(it - halves.begin());
  if (hi == 0) return sign;
  if (hi == halves.size()) return sign | 0x7bff;
  const uint32_t lo = hi - 1;
  const double dlo = a - halves[lo], dhi = halves[hi] - a;
  const uint32_t pick = dlo < dhi ? lo : dhi < dlo ? hi : ((lo & 1) ? hi : lo);
  return static_cast<uint16_t>(sign | pick);
}

// Round to nearest on magnitudes in double, ties to the even pattern; past the largest BF16 the next
// value up is 2^128, which stands for inf.
uint16_t ref_float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  const uint32_t u = float_as_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u, lo = (u >> 16) & 0x7fffu;  // truncation toward zero
  if (lo == 0x7f80u) return static_cast<uint16_t>(sign | lo);             // inf stays inf
  const double a = std::fabs(static_cast<double>(f));
  const double vlo = bf16_bits_to_float(static_cast<uint16_t>(lo));
  const double vhi = lo + 1 == 0x7f80u ? std::ldexp(1.0, 128) : bf16_bits_to_float(static_cast<uint16_t>(lo + 1));
  const double dlo = a - vlo, dhi = vhi - a;
  const uint32_t pick = dlo < dhi ? lo : dhi < dlo ? lo + 1 : ((lo & 1) ? lo + 1 : lo);
  return static_cast<uint16_t>(sign | pick);
}

// The split master's param (core/master_split.h): the BF16 value nearest to f, ties away from zero, by
// value in double; the step past the largest finite BF16 is inf (2^128).
uint16_t ref_bf16_ties_away(float f) {
  const uint32_t u = float_as_bits(f);
  const uint32_t sign = u & 0x80000000u, down = u & 0x7fff0000u;  // magnitude truncated to BF16
  const auto value = [](uint32_t mag) { return mag >= 0x7f800000u ? std::ldexp(1.0, 128) : static_cast<double>(bits_as_float(mag)); };
  const double a = std::fabs(static_cast<double>(f));
  const double below = a - value(down), above = value(down + 0x10000u) - a;
  const uint32_t mag = (below < above ? down : down + 0x10000u) >> 16;
  return static_cast<uint16_t>((sign >> 16) | mag);
}

void check_master_split(uint32_t u) {
  const float f = bits_as_float(u);
  const uint16_t hi = split_master_hi(u);
  const int16_t lo = split_master_lo(u, hi);
  if (std::isnan(f)) {
    CHECK(hi == 0x7fc0 && lo == 0, "split NaN %08x: %04x %d", u, hi, lo);
    return;
  }
  if (std::isinf(f)) {
    CHECK(hi == (u >> 16) && lo == 0, "split inf %08x", u);
    return;
  }
  CHECK(hi == ref_bf16_ties_away(f), "split %08x: param %04x want %04x", u, hi, ref_bf16_ties_away(f));
  CHECK(float_as_bits(join_master(hi, lo)) == u, "split %08x: (%04x << 16) + %d does not rebuild it", u, hi, lo);
}

}  // namespace

int main() {
  // FP16 -> FP32, all 65536 patterns.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = f16_bits_to_float(h);
    const bool nonfinite = ((h >> 10) & 0x1f) == 0x1f;
    CHECK(f16_bits_nonfinite(h) == nonfinite, "nonfinite test of %04x", h);
    if (nonfinite) {
      CHECK((h & 0x3ff) ? std::isnan(f) : (std::isinf(f) && std::signbit(f) == bool(h >> 15)), "inf/nan %04x", h);
    } else {
      CHECK(static_cast<double>(f) == ref_f16_value(h) && std::signbit(f) == bool(h >> 15), "decode %04x", h);
      CHECK(float_to_f16_bits(f) == h, "round trip %04x", h);
    }
  }
  // BF16 -> FP32 -> BF16 round trip, all patterns.
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = bf16_bits_to_float(h);
    CHECK(bf16_bits_nonfinite(h) == !std::isfinite(f), "bf16 nonfinite %04x", h);
    if (!std::isnan(f)) CHECK(float_to_bf16_bits(f) == h, "bf16 round trip %04x", h);
    else CHECK(float_to_bf16_bits(f) == 0x7fc0, "bf16 NaN %04x", h);
  }

  const std::vector<double> halves = half_values();
  // FP32 -> FP16 at every midpoint between adjacent halves and the floats around it.
  for (uint32_t b = 0; b < 0x7c00; ++b) {
    const double mid = b + 1 < 0x7c00 ? (halves[b] + halves[b + 1]) / 2 : 65520.0;
    const float m = static_cast<float>(mid);  // exact: a midpoint has 12 significant bits
    CHECK(static_cast<double>(m) == mid, "midpoint %u not exact", b);
    for (float f : {m, std::nextafter(m, 0.f), std::nextafter(m, 1e30f), -m, static_cast<float>(halves[b])}) {
      CHECK(float_to_f16_bits(f) == ref_float_to_f16(f, halves), "f32 %a -> f16: got %04x want %04x", f,
            float_to_f16_bits(f), ref_float_to_f16(f, halves));
    }
  }
  // Strided sweep of all float bit patterns (includes subnormal, huge, inf and NaN inputs).
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 4099) {
    const float f = bits_as_float(static_cast<uint32_t>(u));
    const uint16_t got = float_to_f16_bits(f);
    if (std::isnan(f)) {
      CHECK((got & 0x7c00) == 0x7c00 && (got & 0x3ff), "nan %08llx -> %04x", (unsigned long long)u, got);
    } else {
      CHECK(got == ref_float_to_f16(f, halves), "f32 %a -> f16: got %04x want %04x", f, got, ref_float_to_f16(f, halves));
    }
    CHECK(float_to_bf16_bits(f) == ref_float_to_bf16(f), "f32 %a -> bf16: got %04x want %04x", f,
          float_to_bf16_bits(f), ref_float_to_bf16(f));
    CHECK(f32_bits_nonfinite(static_cast<uint32_t>(u)) == !std::isfinite(f), "f32 nonfinite %08llx", (unsigned long long)u);
  }
  // BF16 midpoints (ties) and the overflow boundary.
  for (uint32_t hi = 0; hi < 0x7f80; hi += 3) {
    const uint32_t mid = (hi << 16) | 0x8000u;
    for (uint32_t u : {mid, mid - 1, mid + 1}) {
      const float f = bits_as_float(u);
      CHECK(float_to_bf16_bits(f) == ref_float_to_bf16(f), "bf16 tie %08x", u);
    }
  }
  // The split master of master_weights="remainder": a strided sweep over every bit pattern, and every tie,
  // its neighbours and the ends of each BF16 step (remainders -0x8000 and 0x7fff) for a spread of params.
  for (uint64_t u = 0; u <= 0xffffffffull; u += 4099) check_master_split(static_cast<uint32_t>(u));
  for (uint32_t h = 0; h < 0x10000u; h += 7)
    for (uint32_t low : {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) check_master_split((h << 16) | low);
  return native_test::finish("test_numeric");
}
