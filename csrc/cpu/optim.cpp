// CPU backend of the fused optimizer step: any policy of core/optim/ applied by the generic driver of
// optim_impl.inc, parallel over chunks. A step with found_inf != 0 returns before anything is written.
// The per-tensor scalars are computed here on the host (the CPU's "device" values) and the step
// counters are incremented after the pass (a stochastic write-back reads them during it: its stream is the
// step number, count + 1).
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "../kernels.h"
#include "isa.h"

namespace mpf {
namespace {

// What every element of a step shares.
struct StepConsts {
  float grad_mul;   // the unscale factor
  float clip;       // the clip coefficient
  bool write_grad;  // store the gradient used (unscaled, clipped) back into grad
  bool stochastic;  // 16-bit params without a remainder are written with stochastic rounding
  uint64_t seed;
};

using Work = std::vector<std::pair<int64_t, int64_t>>;  // (tensor, chunk) items, tensor by tensor

#define MPF_CPU_IMPL_FILE "optim_impl.inc"
#include "isa_clones.inc"

constexpr int64_t kGrain = int64_t{1} << 16;  // elements per thread before another thread is worth it

template <class P>
void step_with(const OptimArgs& a, int num_threads) {
  double values[kMaxHyper];  // tensor hyperparameters read here: on the CPU, the host is the device
  for (int i = 0; i < P::kNumHyper; ++i) values[i] = read_hyper(a.hyper_ref[i], a.hyper[i]);
  const typename P::Hyper h = P::make(values);
  const double lr = a.lr_ptr ? static_cast<double>(*a.lr_ptr) : a.lr;
  float clip = 1.f;
  double grad_norm = -1.0;
  if (a.clip_sumsq) {
    clip = clip_coefficient(*a.clip_sumsq, a.max_norm);
    grad_norm = std::sqrt(static_cast<double>(*a.clip_sumsq)) * clip;
  }

  std::vector<typename P::Scalars> scalars(static_cast<size_t>(a.num_tensors));
  std::vector<int64_t> numel(static_cast<size_t>(a.num_tensors));
  int64_t total = 0;
  for (int64_t t = 0; t < a.num_tensors; ++t) {
    const OptimTensor& x = a.tensors[t];
    numel[t] = x.numel;
    total += x.numel;
    const double taken = x.step ? static_cast<double>(*x.step) : 0.0;
    scalars[t] = P::scalars(h, StepContext{lr, taken + 1.0, grad_norm});
  }
  Work work;
  for (const PlanLaunch& l : plan_multi_tensor(numel.data(), a.num_tensors, kCpuOptimLimits))
    for (const PlanItem& it : l.items) work.emplace_back(l.tensors[it.slot], it.chunk);

  const StepConsts consts{unscale_factor(a.inv_scale, a.grad_scale), clip, a.write_grad,
                          a.rounding == Rounding::kStochastic, a.seed};
  const int threads = cpu_threads(num_threads, total, kGrain);
  const uint32_t flags = P::flags(h);
  [&] { MPF_CPU_DISPATCH(run<P>(a, flags, consts, scalars.data(), work, threads)); }();

  for (int64_t t = 0; t < a.num_tensors; ++t)
    if (a.tensors[t].step) *a.tensors[t].step += 1.f;
}

}  // namespace

void optim_step_cpu(const OptimArgs& args, int num_threads) {
  if (args.found_inf && *args.found_inf != 0.f) return;  // skipped: params, state and steps untouched
  dispatch_optim(args.kind, [&](auto policy) { step_with<decltype(policy)>(args, num_threads); });
}

}  // namespace mpf
