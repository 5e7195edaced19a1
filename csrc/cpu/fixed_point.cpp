// CPU backend of fixed point <IL, FL> (core/fixed_point.h): Convert over spans of random bits that start
// on Philox block boundaries, and the MACC parallel over output rows. Every element's random bits depend
// only on its index, and the sums are exact integers, so results are the same for every thread count and
// CPU path.
#include <atomic>
#include <cstdint>
#include <memory>
#include <new>

#include "../kernels.h"
#include "isa.h"

namespace mpf {
namespace {

#define MPF_CPU_IMPL_FILE "fixed_point_impl.inc"
#include "isa_clones.inc"

constexpr int64_t kQuantizeGrain = int64_t{1} << 16;  // elements per thread, at least
constexpr int64_t kMatmulGrain = int64_t{1} << 18;    // multiply-adds per thread, at least

}  // namespace

void fixed_quantize_cpu(const FixedQuantizeArgs& a, int num_threads) {
  const int threads = cpu_threads(num_threads, a.numel, kQuantizeGrain);
  [&] { MPF_CPU_DISPATCH(fixed_quantize(a, threads)); }();
}

void fixed_matmul_cpu(const FixedMatmulArgs& g, int num_threads) {
  const int64_t work = g.m * g.n * (g.k > 0 ? g.k : 1);
  int threads = cpu_threads(num_threads, work, kMatmulGrain);
  threads = g.m < threads ? static_cast<int>(g.m < 1 ? 1 : g.m) : threads;  // rows are the unit of work
  [&] { MPF_CPU_DISPATCH(fixed_matmul(g, threads)); }();
}

}  // namespace mpf
