// Philox4x32-10 against the published known-answer vectors (Random123's kat_vectors), the CPU backend's
// vectorised words and rounding against the core functions element by element (on the path chosen by
// MPFUSED_CPU_ISA: make test-native runs this once per path), and the stochastic rounding functions of
// core/stochastic.h against exact counts: for a value x, the number of the 2^16 possible random inputs
// that round x up must be exactly (x - a) / (b - a) * 2^16 (to one count on FP16's subnormal grid).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "check.h"
#include "kernels.h"

using namespace mpf;

namespace {

void known_answers() {
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5u, 0xe169c58du, 0xbc57ac4cu, 0x9b00dbd8u}},
      {{~0u, ~0u, ~0u, ~0u}, {~0u, ~0u}, {0x408f276du, 0x41c83b0eu, 0xa20bc7c6u, 0x6d5451fdu}},
      {{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}, {0xa4093822u, 0x299f31d0u},
       {0xd16cfe09u, 0x94fdccebu, 0x5001e420u, 0x24126ea1u}},
  };
  for (const Kat& k : kats) {
    const Philox4 p = philox4x32_10(k.ctr[0], k.ctr[1], k.ctr[2], k.ctr[3], k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i) CHECK(p.v[i] == k.out[i], "word %d: %08x, expected %08x", i, p.v[i], k.out[i]);
    uint32_t out[4];
    philox_raw_cpu(k.ctr, out, 1, k.key[0], k.key[1]);
    for (int i = 0; i < 4; ++i) CHECK(out[i] == k.out[i], "raw word %d: %08x, expected %08x", i, out[i], k.out[i]);
  }
}

// The backend's words (vector blocks, spans, threads) equal philox_word element by element, for every
// start within a block and across a block index whose low word carries.
void backend_words() {
  const uint64_t seed = 0x0123456789abcdefull;
  const uint64_t offsets[] = {0, 1, 5, 7, 8, 1000003, (uint64_t{1} << 35) - 37, (uint64_t{0xffffffff} << 3) - 3};
  for (uint64_t off : offsets) {
    for (int64_t n : {int64_t{1}, int64_t{9}, int64_t{1023}, int64_t{4099}}) {
      std::vector<uint32_t> w(static_cast<size_t>(n));
      philox_words_cpu(RandomArgs{seed, off, 3, kStreamOptim, n}, w.data(), 2);
      int bad = 0;
      for (int64_t i = 0; i < n; ++i) bad += w[i] != philox_word(seed, off + static_cast<uint64_t>(i), 3, kStreamOptim);
      CHECK(bad == 0, "offset %llu, n %lld: %d words differ", static_cast<unsigned long long>(off),
            static_cast<long long>(n), bad);
    }
  }
}

void backend_rounding() {
  const int64_t n = 70001;
  std::vector<float> x(static_cast<size_t>(n));
  uint32_t s = 12345;
  for (auto& v : x) {  // a spread of magnitudes, signs, subnormals and specials
    s = s * 1664525u + 1013904223u;
    v = bits_as_float(s);
  }
  x[3] = INFINITY, x[4] = -INFINITY, x[5] = NAN, x[6] = 0.f, x[7] = -0.f, x[8] = 65519.f, x[9] = 3e38f;
  for (DType d : {DType::kFloat16, DType::kBFloat16}) {
    for (uint64_t off : {uint64_t{0}, uint64_t{3}, uint64_t{77777}}) {
      std::vector<uint16_t> y(static_cast<size_t>(n));
      round_stochastic_cpu(RandomArgs{99, off, kStreamRound, 0, n}, x.data(), y.data(), d, 2);
      int bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t r = philox_word(99, off + static_cast<uint64_t>(i), kStreamRound, 0);
        const uint16_t want = d == DType::kFloat16 ? float_to_f16_bits_sr(x[i], r) : float_to_bf16_bits_sr(x[i], r);
        const bool nan = std::isnan(x[i]);  // NaN payloads are not part of the contract
        bad += nan ? !(d == DType::kFloat16 ? (y[i] & 0x7fff) > 0x7c00 : (y[i] & 0x7fff) > 0x7f80) : y[i] != want;
      }
      CHECK(bad == 0, "%s offset %llu: %d elements differ from core/stochastic.h", dtype_name(d),
            static_cast<unsigned long long>(off), bad);
    }
  }
}

// The neighbours a <= |x| <= b of a finite non-negative x in FP16 (as doubles), by search.
double f16_value(uint32_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return INFINITY;
  return e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
}

// For |x| (finite, >= 0): how many of the 2^16 random inputs round it up, against the exact count.
void count_check(DType d, float x) {
  const bool f16 = d == DType::kFloat16;
  const double ax = std::fabs(static_cast<double>(x));
  double a, b;
  if (f16) {
    uint32_t lo = 0;
    while (lo + 1 <= 0x7c00 && f16_value(lo + 1) <= ax) ++lo;  // fine for the few values checked
    a = f16_value(lo);
    b = lo == 0x7bff ? 65536.0 : f16_value(lo + 1);  // the step past the largest finite is inf at 2^16
  } else {
    const uint32_t u = float_as_bits(static_cast<float>(ax));
    a = bf16_bits_to_float(static_cast<uint16_t>(u >> 16));
    b = (u >> 16) == 0x7f7f ? std::ldexp(1.0, 128) : bf16_bits_to_float(static_cast<uint16_t>((u >> 16) + 1));
  }
  int ups = 0, others = 0;
  for (uint32_t r16 = 0; r16 < 65536; ++r16) {
    const uint16_t h = f16 ? float_to_f16_bits_sr(x, r16 << 16) : float_to_bf16_bits_sr(x, r16 << 16);
    const double v = std::fabs(static_cast<double>(f16 ? f16_bits_to_float(h) : bf16_bits_to_float(h)));
    const bool sign_ok = (h >> 15) == (float_as_bits(x) >> 31);
    if (!sign_ok) ++others;
    else if (v == a) continue;
    else if (v == b || (std::isinf(v) && b >= (f16 ? 65536.0 : std::ldexp(1.0, 128)))) ++ups;
    else ++others;
  }
  const double exact = ax >= b ? 65536.0 : (ax - a) / (b - a) * 65536.0;  // at or past inf's step: always inf
  const bool subnormal = f16 && ax < std::ldexp(1.0, -14);
  CHECK(others == 0, "%s x=%a: %d results are neither neighbour", dtype_name(d), x, others);
  CHECK(subnormal ? std::fabs(ups - exact) <= 1.0 : ups == exact, "%s x=%a: %d of 65536 round up, expected %.3f",
        dtype_name(d), x, ups, exact);
}

void rounding_counts() {
  const float xs[] = {1.0f + 0x1p-12f, 1.0f + 0x1p-23f, 3.14159265f, 0.1f, 1e-3f, 65504.f + 7.f, 65519.9f,
                      6.0e-5f,  // FP16 normal, just above 2^-14
                      3e-8f, 5.9e-8f * 0.3f, 1e-10f, 1e-30f, 0x1p-40f, 3.3e38f, 1e-40f /* FP32 subnormal */};
  for (DType d : {DType::kFloat16, DType::kBFloat16})
    for (float x : xs) {
      count_check(d, x);
      count_check(d, -x);
    }
}

void grid_values_unchanged() {
  int bad = 0;
  for (uint32_t h = 0; h < 0x7c00; ++h)
    for (uint32_t r : {0u, 0xffff0000u, 0x8a5c0000u}) {
      const float v = f16_bits_to_float(static_cast<uint16_t>(h));
      bad += float_to_f16_bits_sr(v, r) != h;
      bad += float_to_f16_bits_sr(-v, r) != (h | 0x8000u);
      const uint16_t wb = static_cast<uint16_t>(h << 1);  // a spread of BF16 values, both signs
      if ((wb & 0x7fffu) > 0x7f80u) continue;              // NaN payloads are not kept
      bad += float_to_bf16_bits_sr(bf16_bits_to_float(wb), r) != wb;
    }
  CHECK(bad == 0, "%d grid values changed", bad);
  // inf and NaN
  CHECK(float_to_f16_bits_sr(INFINITY, 0xffff0000u) == 0x7c00, "fp16 inf");
  CHECK(float_to_f16_bits_sr(-INFINITY, 0) == 0xfc00, "fp16 -inf");
  CHECK((float_to_f16_bits_sr(NAN, 0xffff0000u) & 0x7fff) > 0x7c00, "fp16 NaN");
  CHECK(float_to_bf16_bits_sr(INFINITY, 0xffff0000u) == 0x7f80, "bf16 inf");
  CHECK((float_to_bf16_bits_sr(-NAN, 0xffff0000u) & 0x7fff) > 0x7f80, "bf16 NaN");
  CHECK(float_to_f16_bits_sr(65536.f, 0) == 0x7c00 && float_to_f16_bits_sr(1e30f, 0) == 0x7c00, "fp16 >= 2^16: inf");
}

// core/stochastic.h's normal-range form (the CUDA optimizer's FP16 write-back takes it for a vector whose
// elements are all in range): where f16_sr_normal_range(x), rounding f16_sr_normal_input(u, r) to nearest
// (float_to_f16_bits: bit-exact with cvt.rn.f16.f32 for every non-NaN input) gives float_to_f16_bits_sr's
// bits; the range is |x| >= 2^-14 and no NaN. FP32 bit patterns in a prime stride over all of them, and each
// binade's edges (its first and last patterns, and the patterns around a carry out of the 13 dropped bits).
void f16_normal_range_form() {
  std::vector<uint32_t> us;
  for (uint64_t u = 0; u <= 0xffffffffu; u += 4099) us.push_back(static_cast<uint32_t>(u));
  for (uint32_t e = 0; e < 256; ++e)
    for (uint32_t m : {0u, 1u, 0x1fffu, 0x2000u, 0x7fe000u, 0x7fdfffu, 0x7fffffu})
      for (uint32_t sign : {0u, 0x80000000u}) us.push_back(sign | e << 23 | m);
  int bad = 0, range_bad = 0;
  long in_range = 0;
  for (uint32_t u : us) {
    const float x = bits_as_float(u);
    const uint32_t a = u & 0x7fffffffu;
    const bool normal = f16_sr_normal_range(x);
    range_bad += normal != (a >= 0x38800000u && a <= 0x7f800000u);
    if (!normal) continue;
    ++in_range;
    for (uint32_t r : {0u, 0xffff0000u, 0x00080000u, 0xfff80000u, 0x8a5c0000u, (u * 2654435761u) & 0xffff0000u})
      bad += float_to_f16_bits(f16_sr_normal_input(u, r)) != float_to_f16_bits_sr(x, r);
  }
  CHECK(range_bad == 0, "%d patterns on the wrong side of f16_sr_normal_range", range_bad);
  CHECK(bad == 0, "%d roundings differ from float_to_f16_bits_sr", bad);
  CHECK(in_range > 100000, "only %ld patterns in range", in_range);
}

}  // namespace

int main() {
  known_answers();
  backend_words();
  backend_rounding();
  rounding_counts();
  grid_values_unchanged();
  f16_normal_range_form();
  return native_test::finish("test_random");
}
