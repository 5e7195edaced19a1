// The CPU paths' FP16/BF16 block conversions (cpu/f16_blocks.inc) against core/numeric.h's scalar ones,
// bit for bit, on every path this CPU runs: every BF16 and FP16 value widened, and FP32 values narrowed
// whose high halves take all 65,536 values with low halves at the rounding edges (0, 1, 0x7FFF, the tie
// 0x8000, 0x8001, 0xFFFF): NaNs of both signs and payloads, infinities, the largest finite values
// rounding up to inf, ties to even, subnormals, zeros of both signs. The arrays are converted in calls
// of every length from 0 to 40 at every offset, so the vector loops, their tails and unaligned pointers
// all run. FP16 NaNs are compared as NaNs (the hardware conversions keep payloads the portable ones do not
// promise); every other value, and every BF16 value, bit for bit.
#include <cstdint>
#include <cstring>
#include <vector>

#include "check.h"
#include "cpu/isa.h"
#include "kernels.h"

namespace mpf {
namespace {

#define MPF_CPU_IMPL_FILE "blocks_clone.inc"
#include "cpu/isa_clones.inc"

struct Blocks {
  const char* name;
  void (*f16_to_f32)(const uint16_t*, float*, int64_t);
  void (*f32_to_f16)(const float*, uint16_t*, int64_t);
  void (*bf16_to_f32)(const uint16_t*, float*, int64_t);
  void (*f32_to_bf16)(const float*, uint16_t*, int64_t);
};

std::vector<Blocks> paths() {
  std::vector<Blocks> p{{"scalar", baseline::f16_block_to_f32, baseline::f32_block_to_f16, baseline::bf16_block_to_f32,
                         baseline::f32_block_to_bf16}};
#if MPF_HAVE_AVX2_CLONES
  if (cpu_supports(CpuIsa::kAvx2))
    p.push_back({"avx2", avx2::f16_block_to_f32, avx2::f32_block_to_f16, avx2::bf16_block_to_f32, avx2::f32_block_to_bf16});
#endif
#if MPF_HAVE_AVX512_CLONES
  if (cpu_supports(CpuIsa::kAvx512))
    p.push_back({"avx512", avx512::f16_block_to_f32, avx512::f32_block_to_f16, avx512::bf16_block_to_f32,
                 avx512::f32_block_to_bf16});
#endif
  return p;
}

// f over [0, n) in calls of lengths 0, 1, ..., 40, 0, 1, ...
template <class F>
void in_pieces(int64_t n, F&& f) {
  for (int64_t at = 0, len = 0; at < n; at += len, len = (len + 1) % 41) f(at, len < n - at ? len : n - at);
}

bool f16_is_nan(uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0; }

}  // namespace
}  // namespace mpf

using namespace mpf;

int main() {
  std::vector<uint16_t> all16(1 << 16);
  for (uint32_t i = 0; i < all16.size(); ++i) all16[i] = static_cast<uint16_t>(i);
  const uint32_t lows[] = {0u, 1u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu};
  std::vector<float> wide;
  for (uint32_t hi = 0; hi < (1u << 16); ++hi)
    for (uint32_t lo : lows) wide.push_back(bits_as_float(hi << 16 | lo));
  const int64_t n16 = static_cast<int64_t>(all16.size()), nw = static_cast<int64_t>(wide.size());

  for (const Blocks& b : paths()) {
    std::vector<float> f(all16.size());
    in_pieces(n16, [&](int64_t at, int64_t len) { b.bf16_to_f32(all16.data() + at, f.data() + at, len); });
    int bad = 0;
    for (int64_t i = 0; i < n16; ++i) bad += float_as_bits(f[i]) != float_as_bits(bf16_bits_to_float(all16[i]));
    CHECK(bad == 0, "%s: %d BF16 values widened differently", b.name, bad);

    in_pieces(n16, [&](int64_t at, int64_t len) { b.f16_to_f32(all16.data() + at, f.data() + at, len); });
    bad = 0;
    for (int64_t i = 0; i < n16; ++i) {
      const float want = f16_bits_to_float(all16[i]);
      bad += f16_is_nan(all16[i]) ? !(f[i] != f[i]) : float_as_bits(f[i]) != float_as_bits(want);
    }
    CHECK(bad == 0, "%s: %d FP16 values widened differently", b.name, bad);

    std::vector<uint16_t> h(wide.size());
    in_pieces(nw, [&](int64_t at, int64_t len) { b.f32_to_bf16(wide.data() + at, h.data() + at, len); });
    bad = 0;
    for (int64_t i = 0; i < nw; ++i) bad += h[i] != float_to_bf16_bits(wide[i]);
    CHECK(bad == 0, "%s: %d FP32 values narrowed to BF16 differently", b.name, bad);
    b.f32_to_bf16(wide.data(), h.data(), nw);  // one call: the vector loops over the whole array
    bad = 0;
    for (int64_t i = 0; i < nw; ++i) bad += h[i] != float_to_bf16_bits(wide[i]);
    CHECK(bad == 0, "%s: %d FP32 values narrowed to BF16 differently in one call", b.name, bad);

    in_pieces(nw, [&](int64_t at, int64_t len) { b.f32_to_f16(wide.data() + at, h.data() + at, len); });
    bad = 0;
    for (int64_t i = 0; i < nw; ++i) {
      const uint16_t want = float_to_f16_bits(wide[i]);
      bad += wide[i] != wide[i] ? !f16_is_nan(h[i]) : h[i] != want;
    }
    CHECK(bad == 0, "%s: %d FP32 values narrowed to FP16 differently", b.name, bad);
    std::printf("test_blocks: path %s checked\n", b.name);
  }
  return native_test::finish("test_blocks");
}
