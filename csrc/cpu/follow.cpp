// CPU backend of following a write from outside the optimizer step (core/follow.h): one pass over each
// followed param and its master or remainder, parallel over chunks of the same plan the CUDA backend uses.
// Every element is judged alone, so the result does not depend on threads or chunking.
#include <cstdint>
#include <utility>
#include <vector>

#include "../kernels.h"
#include "isa.h"

namespace mpf {
namespace {

using FollowWork = std::vector<std::pair<int64_t, int64_t>>;  // (tensor, chunk) items

#define MPF_CPU_IMPL_FILE "follow_impl.inc"
#include "isa_clones.inc"

constexpr int64_t kGrain = int64_t{1} << 17;  // elements per thread before another thread is worth it

}  // namespace

void follow_writes_cpu(const FollowArgs& a, int num_threads) {
  std::vector<int64_t> numel(static_cast<size_t>(a.num_tensors));
  int64_t total = 0;
  for (int64_t t = 0; t < a.num_tensors; ++t) total += numel[static_cast<size_t>(t)] = a.tensors[t].numel;
  FollowWork work;
  for (const PlanLaunch& l : plan_multi_tensor(numel.data(), a.num_tensors, kCpuFollowLimits))
    for (const PlanItem& it : l.items) work.emplace_back(l.tensors[it.slot], it.chunk);
  if (work.empty()) return;
  const int threads = cpu_threads(num_threads, total, kGrain);
  [&] { MPF_CPU_DISPATCH(follow_writes(a, work, threads)); }();
}

}  // namespace mpf
