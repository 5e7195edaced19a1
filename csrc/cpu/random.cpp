// CPU backend of the random bits and of stochastic rounding: Philox words drawn in vectorised blocks
// (philox_blocks.inc), the rounding of core/stochastic.h, parallel over spans that start on Philox block boundaries. Every
// element's word depends only on its index, so the result is the same for every thread count and path.
#include <cstdint>

#include "../core/dispatch.h"
#include "../kernels.h"
#include "isa.h"

namespace mpf {
namespace {

#define MPF_CPU_IMPL_FILE "random_impl.inc"
#include "isa_clones.inc"

constexpr int64_t kGrain = int64_t{1} << 16;

}  // namespace

void philox_raw_cpu(const uint32_t* ctr, uint32_t* out, int64_t n, uint32_t k0, uint32_t k1) {
  for (int64_t i = 0; i < n; ++i) {
    const Philox4 p = philox4x32_10(ctr[4 * i], ctr[4 * i + 1], ctr[4 * i + 2], ctr[4 * i + 3], k0, k1);
    for (int k = 0; k < 4; ++k) out[4 * i + k] = p.v[k];
  }
}

void philox_words_cpu(const RandomArgs& r, uint32_t* words, int num_threads) {
  const int threads = cpu_threads(num_threads, r.numel, kGrain);
  [&] { MPF_CPU_DISPATCH(philox_words(r, words, threads)); }();
}

void round_stochastic_cpu(const RandomArgs& r, const float* src, void* dst, DType dst_dtype, int num_threads) {
  const int threads = cpu_threads(num_threads, r.numel, kGrain);
  [&] { MPF_CPU_DISPATCH(round_stochastic(r, src, dst, dst_dtype, threads)); }();
}

}  // namespace mpf
