// The CPU optimizer backend without torch: one element of every tensor is recomputed with the scalar
// core/optim.h math and compared bit for bit; a found_inf step writes nothing; steps advance.
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
  OptimTensor t{param.data(), grad.data(), master.data(), m.data(), v.data(), vmax.data(), &step, n, DType::kFloat16};
  OptimArgs a{};
  a.kind = OptimKind::kAdam;
  a.tensors = &t;
  a.num_tensors = 1;
  a.lr = 0.0;
  a.lr_ptr = &lr_dev;
  a.adam = AdamHyper{0.9, 0.999, 1e-8, 0.01, true, false, true};
  a.inv_scale = &inv;
  a.found_inf = &found;

  for (int s = 0; s < 3; ++s) {
    std::vector<float> rm = master, rmm = m, rv = v, rvmax = vmax;
    const AdamScalars sc = adam_scalars(a.adam, lr_dev, step + 1.0);
    optim_step_cpu(a, 2);
    CHECK(step == s + 1.f, "step %g after %d steps", step, s + 1);
    for (int64_t i = 0; i < n; ++i) {
      const float g = fmul(fmul(f16_bits_to_float(grad[i]), inv), 1.f);
      adam_update(rm[i], rmm[i], rv[i], rvmax[i], g, adam_variant(a.adam, sc), sc);
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
