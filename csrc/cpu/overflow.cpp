// CPU backend of the multi-tensor overflow reduction: the core/overflow.h step over every chunk of
// the same plan the CUDA backend uses, in parallel over chunks. The sum of squares is reduced per
// chunk and the chunk partials are added in plan order, so the result does not depend on the number
// of threads.
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "../core/overflow.h"
#include "../kernels.h"
#include "isa.h"

namespace mpf {
namespace {

#define MPF_CPU_IMPL_FILE "overflow_impl.inc"
#include "isa_clones.inc"

}  // namespace

void overflow_check_cpu(const OverflowArgs& a, int num_threads) {
  if (num_threads < 1) num_threads = 1;
  std::vector<int64_t> numel(static_cast<size_t>(a.num_tensors));
  for (int64_t t = 0; t < a.num_tensors; ++t) numel[t] = a.tensors[t].numel;
  // The CPU has no parameter-space limit, so the plan is a single launch; flatten it anyway.
  std::vector<std::pair<int64_t, int64_t>> work;  // (tensor, chunk)
  for (const PlanLaunch& l : plan_multi_tensor(numel.data(), a.num_tensors, kCpuOverflowLimits))
    for (const PlanItem& it : l.items) work.emplace_back(l.tensors[it.slot], it.chunk);
  if (a.overwrite) {  // this call's result alone
    *a.found_inf = 0.0f;
    if (a.sumsq) *a.sumsq = 0.0f;
  }
  if (!work.empty()) {
    dispatch_overflow_mode(a.inv_scale != nullptr, a.unscale, a.sumsq != nullptr, [&](auto mode) {
    using Mode = decltype(mode);
    MPF_CPU_DISPATCH(run<Mode>(a, work, num_threads));
    });
  }
  if (a.norm && a.sumsq) *a.norm = std::sqrt(*a.sumsq);
}

}  // namespace mpf
