// CPU backend of the fused optimizer step: for every element, the unscaled gradient, the core/optim.h
// update of the FP32 weight (the master copy when there is one) and its moments, and the store of the
// weight in the model's dtype, in one pass; parallel over chunks. A step with found_inf != 0 returns
// before anything is written. Step counters are incremented after the pass.
#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "../kernels.h"
#include "isa.h"

#if MPF_HAVE_AVX2_CLONES
#include <immintrin.h>
#endif

namespace mpf {
namespace {

// What every element of a step shares, read once on the host (the CPU's "device" values).
struct StepConsts {
  float grad_mul;   // inv_scale
  float clip;       // clip coefficient
  const AdamScalars* adam;  // per tensor
  const SgdScalars* sgd;
  const uint8_t* first_step;  // per tensor (SGD momentum)
  bool write_grad;  // store the gradient used (unscaled, clipped) back into grad
};

#define MPF_CPU_IMPL_FILE "optim_impl.inc"
#include "isa_clones.inc"

constexpr int64_t kGrain = int64_t{1} << 16;  // elements per thread before another thread is worth it

}  // namespace

void optim_step_cpu(const OptimArgs& args, int num_threads) {
  if (args.found_inf && *args.found_inf != 0.f) return;  // skipped: params, state and steps untouched
  OptimArgs a = args;  // with the tensor hyperparameters read (on the CPU, the host is the device)
  a.adam = resolve_hyper(args.adam, args.hyper);
  a.sgd = resolve_hyper(args.sgd, args.hyper);
  const double lr = a.lr_ptr ? static_cast<double>(*a.lr_ptr) : a.lr;

  std::vector<AdamScalars> adam(static_cast<size_t>(a.num_tensors));
  std::vector<SgdScalars> sgd(static_cast<size_t>(a.num_tensors));
  std::vector<uint8_t> first(static_cast<size_t>(a.num_tensors), 0);
  std::vector<int64_t> numel(static_cast<size_t>(a.num_tensors));
  int64_t total = 0;
  for (int64_t t = 0; t < a.num_tensors; ++t) {
    const OptimTensor& x = a.tensors[t];
    numel[t] = x.numel;
    total += x.numel;
    const double step = x.step ? static_cast<double>(*x.step) : 0.0;
    if (a.kind == OptimKind::kAdam) adam[t] = adam_scalars(a.adam, lr, step + 1.0);
    else sgd[t] = sgd_scalars(a.sgd, lr);
    first[t] = step == 0.0;
  }
  std::vector<std::pair<int64_t, int64_t>> work;
  for (const PlanLaunch& l : plan_multi_tensor(numel.data(), a.num_tensors, kCpuOptimLimits))
    for (const PlanItem& it : l.items) work.emplace_back(l.tensors[it.slot], it.chunk);

  float clip = a.clip_coef ? *a.clip_coef : 1.f;
  if (a.clip_sumsq) clip = fmul(clip, clip_coefficient(*a.clip_sumsq, a.max_norm));
  const StepConsts consts{unscale_factor(a.inv_scale, a.grad_scale), clip, adam.data(), sgd.data(), first.data(), a.write_grad};
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::max(num_threads, 1), total / kGrain)));
  auto go = [&](auto kind) {
    constexpr OptimKind K = decltype(kind)::value;
    MPF_CPU_DISPATCH(run<K>(a, consts, work, threads));
  };
  if (a.kind == OptimKind::kAdam) go(std::integral_constant<OptimKind, OptimKind::kAdam>{});
  else go(std::integral_constant<OptimKind, OptimKind::kSgd>{});

  for (int64_t t = 0; t < a.num_tensors; ++t)
    if (a.tensors[t].step) *a.tensors[t].step += 1.f;
}

}  // namespace mpf
