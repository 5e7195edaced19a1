// The CPU optimizer backend without torch: every element is recomputed with the scalar core/optim/ policy
// math (AdamPolicy through the generic driver) and compared bit for bit; a found_inf step writes nothing;
// steps advance.
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "check.h"
#include "kernels.h"

using namespace mpf;

int main() {
  std::mt19937 rng(3);
  std::normal_distribution<float> dist(0.f, 1.f);
  const int64_t n = 3 * kCpuOptimLimits.chunk_size + 11;
  std::vector<float> master(n), m(n, 0.f), v(n, 0.f), vmax(n, 0.f);
  std::vector<uint16_t> param(n), grad(n);
  for (int64_t i = 0; i < n; ++i) {
    master[i] = dist(rng);
    param[i] = float_to_f16_bits(master[i]);
    grad[i] = float_to_f16_bits(dist(rng) * 1024.f);
  }
  float step = 0.f, inv = 1.f / 1024.f, found = 0.f, lr_dev = 1e-3f;
  OptimTensor t{param.data(), grad.data(), master.data(), {m.data(), v.data(), vmax.data()}, &step, n, DType::kFloat16, nullptr, 0};
  OptimArgs a{};
  a.kind = OptimKind::kAdam;
  a.tensors = &t;
  a.num_tensors = 1;
  a.lr = 0.0;
  a.lr_ref = HyperRef{&lr_dev, false};
  const double hyper[AdamPolicy::kNumHyper] = {0.9, 0.999, 1e-8, 0.01, 1, 0, 1};  // amsgrad, AdamW
  for (int i = 0; i < AdamPolicy::kNumHyper; ++i) a.hyper[i] = hyper[i];
  const AdamPolicy::Hyper h = AdamPolicy::make(hyper);
  const RuntimeFlags flags{AdamPolicy::flags(h)};
  CHECK(flags.has(AdamPolicy::kAmsgrad) && !flags.has(AdamPolicy::kL2), "flags %u", flags.mask);
  a.inv_scale = &inv;
  a.found_inf = &found;

  for (int s = 0; s < 3; ++s) {
    std::vector<float> rm = master, rmm = m, rv = v, rvmax = vmax;
    const AdamPolicy::Scalars sc = AdamPolicy::scalars(h, StepContext{lr_dev, step + 1.0, -1.0});
    optim_step_cpu(a, 2);
    CHECK(step == s + 1.f, "step %g after %d steps", step, s + 1);
    for (int64_t i = 0; i < n; ++i) {
      const float g = fmul(fmul(f16_bits_to_float(grad[i]), inv), 1.f);
      float s3[3] = {rmm[i], rv[i], rvmax[i]};
      AdamPolicy::update(rm[i], s3, g, flags, sc);
      rmm[i] = s3[0], rv[i] = s3[1], rvmax[i] = s3[2];
      CHECK(rm[i] == master[i] && rmm[i] == m[i] && rv[i] == v[i] && rvmax[i] == vmax[i], "element %lld step %d", (long long)i, s);
      CHECK(param[i] == float_to_f16_bits(master[i]), "param copy of element %lld", (long long)i);
      if (rm[i] != master[i]) break;
    }
  }
  // A skipped step writes nothing, steps included.
  found = 2.f;
  const std::vector<float> before = master;
  const std::vector<uint16_t> pbefore = param;
  optim_step_cpu(a, 2);
  CHECK(step == 3.f && before == master && pbefore == param, "a skipped step wrote");
  return native_test::finish("test_cpu_optim");
}
