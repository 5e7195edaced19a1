// The CPU backend of the overflow reduction, without torch: detection at chunk boundaries for every
// dtype, unscale against the scalar core math, the sum against FP64, and determinism across thread
// counts.
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "check.h"
#include "core/numeric.h"
#include "kernels.h"

using namespace mpf;

namespace {

struct Buffer {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> u16;
  Buffer(DType d, int64_t n, std::mt19937& rng) : dtype(d) {
    std::normal_distribution<float> dist(0.f, 100.f);
    if (d == DType::kFloat32) f32.resize(n);
    else u16.resize(n);
    for (int64_t i = 0; i < n; ++i) set(i, dist(rng));
  }
  void set(int64_t i, float v) {
    if (dtype == DType::kFloat32) f32[i] = v;
    else u16[i] = dtype == DType::kFloat16 ? float_to_f16_bits(v) : float_to_bf16_bits(v);
  }
  float get(int64_t i) const {
    if (dtype == DType::kFloat32) return f32[i];
    return dtype == DType::kFloat16 ? f16_bits_to_float(u16[i]) : bf16_bits_to_float(u16[i]);
  }
  int64_t size() const { return dtype == DType::kFloat32 ? static_cast<int64_t>(f32.size()) : static_cast<int64_t>(u16.size()); }
  TensorRef ref() { return {dtype == DType::kFloat32 ? static_cast<void*>(f32.data()) : u16.data(), size(), dtype}; }
};

float run(std::vector<Buffer>& bufs, const float* inv, bool unscale, float* sumsq, int threads) {
  std::vector<TensorRef> refs;
  for (auto& b : bufs) refs.push_back(b.ref());
  float found = 0.f;
  OverflowArgs args{refs.data(), static_cast<int64_t>(refs.size()), &found, inv, unscale, sumsq, false, nullptr, nullptr};
  overflow_check_cpu(args, threads);
  return found;
}

}  // namespace

int main() {
  std::mt19937 rng(7);
  const int64_t chunk = kCpuOverflowLimits.chunk_size;
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (DType d : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const int64_t n = 2 * chunk + 5;
    for (int64_t pos : {int64_t{0}, chunk - 1, chunk, 2 * chunk - 1, 2 * chunk, n - 1}) {
      for (float bad : {nan, inf, -inf}) {
        std::vector<Buffer> bufs{Buffer(d, 3, rng), Buffer(d, n, rng)};
        CHECK(run(bufs, nullptr, false, nullptr, 2) == 0.f, "%s: clean list flagged", dtype_name(d));
        bufs[1].set(pos, bad);
        CHECK(run(bufs, nullptr, false, nullptr, 2) == 1.f, "%s: %f at %lld missed", dtype_name(d), bad, (long long)pos);
      }
    }
    // Unscale: every element equals the scalar core math; the sum matches FP64.
    std::vector<Buffer> bufs{Buffer(d, 1, rng), Buffer(d, chunk + 3, rng), Buffer(d, 1000, rng)};
    std::vector<std::vector<float>> before;
    double ref_sum = 0.0;
    const float inv = 1.f / 3.f;
    for (auto& b : bufs) {
      before.emplace_back();
      for (int64_t i = 0; i < b.size(); ++i) {
        before.back().push_back(b.get(i));
        const double v = static_cast<double>(b.get(i) * inv);
        ref_sum += v * v;
      }
    }
    float sumsq = 0.f;
    CHECK(run(bufs, &inv, true, &sumsq, 2) == 0.f, "%s: unscale flagged", dtype_name(d));
    CHECK(std::fabs(sumsq - ref_sum) <= 2.5e-4 * ref_sum, "%s: sumsq %g vs %g", dtype_name(d), sumsq, ref_sum);
    for (size_t t = 0; t < bufs.size(); ++t) {
      for (int64_t i = 0; i < bufs[t].size(); ++i) {
        Buffer expect = bufs[t];
        expect.set(i, before[t][i] * inv);  // rounds exactly like the kernel's store
        CHECK(bufs[t].get(i) == expect.get(i), "%s: unscaled element %lld", dtype_name(d), (long long)i);
        if (bufs[t].get(i) != expect.get(i)) break;
      }
    }
  }
  // The sum does not depend on the thread count.
  std::vector<Buffer> bufs{Buffer(DType::kFloat16, 5 * chunk + 1, rng), Buffer(DType::kFloat32, 3 * chunk, rng)};
  float s1 = 0.f, s4 = 0.f;
  run(bufs, nullptr, false, &s1, 1);
  run(bufs, nullptr, false, &s4, 4);
  CHECK(s1 == s4, "sum depends on threads: %.9g vs %.9g", s1, s4);

  // Overwrite mode: stale found_inf and sumsq are replaced by this call's result, and the norm is
  // sqrt(sumsq); an empty list yields zeros.
  {
    std::vector<TensorRef> refs;
    for (auto& b : bufs) refs.push_back(b.ref());
    float found = 1.f, sumsq = 123.f, norm = -1.f;
    OverflowArgs args{refs.data(), static_cast<int64_t>(refs.size()), &found, nullptr, false, &sumsq, true, &norm, nullptr};
    overflow_check_cpu(args, 2);
    CHECK(found == 0.f, "overwrite: stale found_inf kept (%g)", found);
    CHECK(sumsq == s1, "overwrite: sumsq %.9g, expected %.9g", sumsq, s1);
    CHECK(norm == std::sqrt(s1), "overwrite: norm %.9g, expected %.9g", norm, std::sqrt(s1));
    bufs[0].set(17, nan);
    overflow_check_cpu(args, 2);
    CHECK(found == 1.f, "overwrite: NaN missed");
    found = 1.f, sumsq = 5.f, norm = 5.f;
    OverflowArgs empty{refs.data(), 0, &found, nullptr, false, &sumsq, true, &norm, nullptr};
    overflow_check_cpu(empty, 2);
    CHECK(found == 0.f && sumsq == 0.f && norm == 0.f, "overwrite of an empty list: %g %g %g", found, sumsq, norm);
  }
  return native_test::finish("test_cpu_overflow");
}
