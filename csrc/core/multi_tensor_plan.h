// Host-side planning of multi-tensor launches. Plain C++, no CUDA, no torch: unit-tested natively.
//
// A list of tensors is cut into chunks of `chunk_size` elements. A work item is one (tensor, chunk)
// pair; a launch carries at most `max_tensors` tensor slots and `max_items` work items, which is what
// fits in one kernel's parameter space. Items are emitted in list order, so a launch's items and the
// partial results derived from them have a fixed order (deterministic reductions). A tensor larger
// than one launch's item capacity continues in the next launch, in the same slot position 0.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace mpf {

struct PlanLimits {
  int64_t chunk_size;   // elements per work item
  int64_t max_tensors;  // tensor slots per launch
  int64_t max_items;    // work items per launch
};

struct PlanItem {
  int32_t slot;   // index into the launch's tensors
  int32_t chunk;  // chunk index within that tensor: elements [chunk*chunk_size, +chunk_size)
};

struct PlanLaunch {
  std::vector<int64_t> tensors;  // indices into the caller's list
  std::vector<PlanItem> items;
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// numel[i] is the element count of tensor i; tensors with numel == 0 take no slot and no item.
inline std::vector<PlanLaunch> plan_multi_tensor(const int64_t* numel, int64_t n, const PlanLimits& lim) {
  if (lim.chunk_size <= 0 || lim.max_tensors <= 0 || lim.max_items <= 0)
    throw std::invalid_argument("plan_multi_tensor: limits must be positive");
  std::vector<PlanLaunch> launches;
  PlanLaunch cur;
  auto flush = [&]() {
    if (!cur.items.empty()) launches.push_back(std::move(cur));
    cur = PlanLaunch{};
  };
  for (int64_t t = 0; t < n; ++t) {
    if (numel[t] < 0) throw std::invalid_argument("plan_multi_tensor: negative numel for tensor " + std::to_string(t));
    if (numel[t] == 0) continue;
    const int64_t chunks = ceil_div(numel[t], lim.chunk_size);
    if (chunks > INT32_MAX)
      throw std::invalid_argument("plan_multi_tensor: tensor " + std::to_string(t) + " has more than 2^31 chunks");
    int64_t next = 0;
    while (next < chunks) {
      if (static_cast<int64_t>(cur.tensors.size()) == lim.max_tensors ||
          static_cast<int64_t>(cur.items.size()) == lim.max_items)
        flush();
      const int32_t slot = static_cast<int32_t>(cur.tensors.size());
      cur.tensors.push_back(t);
      const int64_t room = lim.max_items - static_cast<int64_t>(cur.items.size());
      const int64_t take = chunks - next < room ? chunks - next : room;
      for (int64_t c = 0; c < take; ++c) cur.items.push_back(PlanItem{slot, static_cast<int32_t>(next + c)});
      next += take;
    }
  }
  flush();
  return launches;
}

// The CUDA multi-tensor launches pass up to 32 KB of kernel arguments (the tensor lists above), which the
// CUDA 12.1 runtime and a driver of CUDA 12.1 or newer (R530+) accept; an older driver refuses the launch
// with an unhelpful error. cudaDriverGetVersion's value (1000 * major + 10 * minor; 0: no driver) is
// checked before the first such launch.
constexpr int kLargeKernelParamsDriver = 12010;

// Empty when `driver_version` can launch the multi-tensor kernels, else the error to raise, naming it.
inline std::string large_kernel_params_driver_error(int driver_version) {
  if (driver_version >= kLargeKernelParamsDriver) return {};
  const std::string found = driver_version <= 0 ? std::string("no CUDA driver (cudaDriverGetVersion gave ") +
                                                      std::to_string(driver_version) + ")"
                                                : "a driver for CUDA " + std::to_string(driver_version / 1000) + "." +
                                                      std::to_string((driver_version % 1000) / 10);
  return "mpfused: this machine has " + found + "; mpfused's multi-tensor CUDA kernels pass up to 32 KB of kernel "
         "arguments, which needs an NVIDIA driver for CUDA 12.1 or newer (R530 or later). Update the NVIDIA driver.";
}

inline int64_t plan_total_items(const std::vector<PlanLaunch>& plan) {
  int64_t total = 0;
  for (const auto& l : plan) total += static_cast<int64_t>(l.items.size());
  return total;
}

}  // namespace mpf
